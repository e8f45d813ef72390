package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemreg/idemreg/client/fence"
)

// schema is the ledger: one entry per payment. Balances are sums of
// entries, so an entry written twice would show as a double charge and a
// missing one as a gap. The entries are written with a plain upsert: what
// keeps a stale holder out is the fence (ledger_fence, created from
// ledgerFence.Schema()), applied in the same transaction.
const schema = `
CREATE TABLE IF NOT EXISTS ledger_entries (
	payment_id   text PRIMARY KEY,
	account      text NOT NULL,
	amount_minor bigint NOT NULL,
	-- The idemreg token and attempt of the claim that wrote the entry, for
	-- diagnostics: attempt above 1 means it was written (again) after a
	-- takeover from a holder whose lease ran out.
	token        bigint NOT NULL,
	attempt      bigint NOT NULL,
	-- The consumer process that wrote it.
	writer       text NOT NULL,
	applied_at   timestamptz NOT NULL DEFAULT now()
);
CREATE OR REPLACE VIEW account_balances AS
	SELECT account, sum(amount_minor)::bigint AS balance_minor, count(*) AS entries
	FROM ledger_entries GROUP BY account;
`

// ledgerFence records, per payment, the largest token that wrote its
// entry.
var ledgerFence = func() *fence.Fence {
	f, err := fence.New("ledger_fence")
	if err != nil {
		panic(err) // a constant name: caught by every test
	}
	return f
}()

// pgxTx lets the fence run in a pgx transaction: pgx.Tx's QueryRow returns
// pgx.Row, which has the Scan that fence.Row asks for.
type pgxTx struct{ pgx.Tx }

func (t pgxTx) QueryRow(ctx context.Context, query string, args ...any) fence.Row {
	return t.Tx.QueryRow(ctx, query, args...)
}

// Ledger is the PostgreSQL ledger the consumer applies payments to.
type Ledger struct {
	db     *pgxpool.Pool
	writer string
}

func openLedger(ctx context.Context, url, writer string) (*Ledger, error) {
	db, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	if err := createSchema(ctx, db); err != nil {
		db.Close()
		return nil, fmt.Errorf("ledger: schema: %w", err)
	}
	return &Ledger{db: db, writer: writer}, nil
}

// createSchema creates the tables once, whatever the number of replicas
// starting at the same time: CREATE ... IF NOT EXISTS alone races in
// PostgreSQL.
func createSchema(ctx context.Context, db *pgxpool.Pool) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('examples/ledger schema'))`); err != nil {
		return err
	}
	for _, ddl := range []string{schema, ledgerFence.Schema()} {
		if _, err := tx.Exec(ctx, ddl); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}

func (l *Ledger) Close() { l.db.Close() }

// Apply writes the payment's entry under token, in one transaction with
// the fence: the entry is inserted, or replaced when a smaller token wrote
// it (a takeover of a holder that crashed after its write), and never
// written by a holder whose token is older than the fence's (a holder that
// stalled past its lease): that one gets an error matching fence.ErrStale
// and its transaction rolls back. The entry is keyed by the payment id, so
// applying a payment twice leaves one entry; the same token applying again
// (its own write already committed) writes nothing and returns nil.
func (l *Ledger) Apply(ctx context.Context, p Payment, token, attempt int64) error {
	err := pgx.BeginFunc(ctx, l.db, func(tx pgx.Tx) error {
		if err := ledgerFence.ApplyWith(ctx, pgxTx{tx}, consumer, p.ID, token); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `
			INSERT INTO ledger_entries (payment_id, account, amount_minor, token, attempt, writer)
			VALUES ($1, $2, $3, $4, $5, $6)
			ON CONFLICT (payment_id) DO UPDATE
				SET account = EXCLUDED.account, amount_minor = EXCLUDED.amount_minor,
				    token = EXCLUDED.token, attempt = EXCLUDED.attempt, writer = EXCLUDED.writer,
				    applied_at = now()`,
			p.ID, p.Account, p.AmountMinor, token, attempt, l.writer)
		return err
	})
	if errors.Is(err, fence.ErrAlreadyApplied) {
		return nil // this claim's own entry is there
	}
	if err != nil {
		return fmt.Errorf("ledger: apply %s: %w", p.ID, err)
	}
	return nil
}
