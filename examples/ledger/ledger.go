package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// schema is the ledger: one entry per payment, written with the fencing
// token of the idemreg claim it was applied under. Balances are sums of
// entries, so an entry written twice would show as a double charge and a
// missing one as a gap.
const schema = `
CREATE TABLE IF NOT EXISTS ledger_entries (
	payment_id   text PRIMARY KEY,
	account      text NOT NULL,
	amount_minor bigint NOT NULL,
	-- The idemreg token of the claim that wrote the entry. A write only
	-- replaces an entry written under a smaller token.
	fence        bigint NOT NULL,
	-- The claim's attempt: above 1, the entry was written (again) after a
	-- takeover from a holder whose lease ran out.
	attempt      bigint NOT NULL,
	-- The consumer process that wrote it, for diagnostics.
	writer       text NOT NULL,
	applied_at   timestamptz NOT NULL DEFAULT now()
);
CREATE OR REPLACE VIEW account_balances AS
	SELECT account, sum(amount_minor)::bigint AS balance_minor, count(*) AS entries
	FROM ledger_entries GROUP BY account;
`

// errStale says a holder with a newer token already wrote the entry: this
// holder's lease ran out and someone took over. Its write must not land.
var errStale = errors.New("ledger: a newer holder already wrote this entry")

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
	if _, err := tx.Exec(ctx, schema); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

func (l *Ledger) Close() { l.db.Close() }

// Apply writes the payment's entry, fenced by token: the entry is inserted,
// or replaced when it was written under a smaller token (a takeover of a
// holder that crashed after its write), and never replaced by a holder
// whose token is older than the entry's (a holder that stalled past its
// lease). The entry is keyed by the payment id, so applying a payment twice
// leaves one entry.
func (l *Ledger) Apply(ctx context.Context, p Payment, token, attempt int64) error {
	tag, err := l.db.Exec(ctx, `
		INSERT INTO ledger_entries (payment_id, account, amount_minor, fence, attempt, writer)
		VALUES ($1, $2, $3, $4, $5, $6)
		ON CONFLICT (payment_id) DO UPDATE
			SET account = EXCLUDED.account, amount_minor = EXCLUDED.amount_minor,
			    fence = EXCLUDED.fence, attempt = EXCLUDED.attempt, writer = EXCLUDED.writer,
			    applied_at = now()
			WHERE ledger_entries.fence < EXCLUDED.fence`,
		p.ID, p.Account, p.AmountMinor, token, attempt, l.writer)
	if err != nil {
		return fmt.Errorf("ledger: apply %s: %w", p.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return errStale
	}
	return nil
}
