package fence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
)

// ErrStale says a newer token has already applied the key: the holder's
// lease ran out and another holder took over. Roll the transaction back.
// Errors returned by Apply match it with errors.Is; errors.As with a
// *StaleError gives the token that applied.
var ErrStale = errors.New("fence: a newer token already applied this key")

// ErrAlreadyApplied says this very token applied the key in a transaction
// that committed earlier: the holder's own write landed (it is retrying
// after an ambiguous commit, or redoing work it already did). Roll the
// transaction back and treat the key as applied.
var ErrAlreadyApplied = errors.New("fence: this token already applied this key")

// StaleError is the ErrStale of one key, with the token that applied it.
type StaleError struct {
	Consumer, Key string
	// Token is the token that was refused; Applied the newer one that
	// applied the key.
	Token, Applied int64
}

func (e *StaleError) Error() string {
	return fmt.Sprintf("fence: %s/%s: token %d is stale, token %d already applied", e.Consumer, e.Key, e.Token, e.Applied)
}

// Is makes errors.Is(err, ErrStale) true.
func (e *StaleError) Is(target error) bool { return target == ErrStale }

// Row is the one row a query returns: a *sql.Row, or a pgx.Row.
type Row interface {
	Scan(dest ...any) error
}

// Querier runs a query in the caller's transaction. It is the seam for
// drivers that do not go through database/sql. Its Row's Scan must return
// an error matching sql.ErrNoRows when there is no row (pgx's ErrNoRows
// does, from pgx v5.6). A pgx.Tx needs an adapter only because its
// QueryRow returns pgx.Row:
//
//	type pgxTx struct{ pgx.Tx }
//	func (t pgxTx) QueryRow(ctx context.Context, q string, args ...any) fence.Row {
//		return t.Tx.QueryRow(ctx, q, args...)
//	}
type Querier interface {
	QueryRow(ctx context.Context, query string, args ...any) Row
}

// Fence writes one fence table. It holds only the table's name and the
// statements built from it, so one Fence is safe for concurrent use.
type Fence struct {
	table   string // validated and quoted
	schema  string
	apply   string
	current string
}

// maxIdentifier is PostgreSQL's NAMEDATALEN-1; CockroachDB accepts longer
// names, but a name it would truncate is a mistake either way.
const maxIdentifier = 63

// New returns the Fence of table, a table name or schema.table made of
// lower-case ASCII letters, digits and underscores (not starting with a
// digit). The name is checked here, not escaped, because it is spliced into
// SQL: anything else is refused rather than quoted into a name nobody
// meant.
func New(table string) (*Fence, error) {
	parts := strings.Split(table, ".")
	if len(parts) > 2 {
		return nil, fmt.Errorf("fence: table %q: at most schema.table", table)
	}
	quoted := make([]string, len(parts))
	for i, p := range parts {
		if err := checkIdentifier(p); err != nil {
			return nil, fmt.Errorf("fence: table %q: %w", table, err)
		}
		// Quoted so that a valid name that happens to be a keyword
		// ("order", "user") still works.
		quoted[i] = `"` + p + `"`
	}
	t := strings.Join(quoted, ".")
	return &Fence{
		table: t,
		schema: `CREATE TABLE IF NOT EXISTS ` + t + ` (
	consumer   text NOT NULL,
	key        text NOT NULL,
	-- The largest idemreg token that applied (consumer, key).
	token      bigint NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (consumer, key)
)`,
		// In PostgreSQL the conflicting row is locked even when the WHERE
		// refuses the update (and under REPEATABLE READ or SERIALIZABLE a
		// row newer than the snapshot is a serialization failure), so a
		// refused Apply holds the row until its transaction ends and the
		// follow-up read in current sees the token that won. CockroachDB
		// runs SERIALIZABLE by default: a concurrent change between the
		// two statements aborts one of the transactions.
		apply: `INSERT INTO ` + t + ` AS cur (consumer, key, token, applied_at)
	VALUES ($1, $2, $3, now())
	ON CONFLICT (consumer, key) DO UPDATE
		SET token = excluded.token, applied_at = excluded.applied_at
		WHERE cur.token < excluded.token
	RETURNING token`,
		current: `SELECT token FROM ` + t + ` WHERE consumer = $1 AND key = $2`,
	}, nil
}

func checkIdentifier(s string) error {
	if s == "" {
		return errors.New("empty identifier")
	}
	if len(s) > maxIdentifier {
		return fmt.Errorf("identifier longer than %d bytes", maxIdentifier)
	}
	for i, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r == '_':
		case r >= '0' && r <= '9' && i > 0:
		default:
			return fmt.Errorf("identifier %q: only a-z, 0-9 and _, not starting with a digit", s)
		}
	}
	return nil
}

// Table is the table's name as it appears in the SQL (quoted).
func (f *Fence) Table() string { return f.table }

// Schema is the DDL of the fence table (CREATE TABLE IF NOT EXISTS), for
// the caller's migrations.
func (f *Fence) Schema() string { return f.schema }

// Apply records in tx that consumer's key is applied under token, the
// idemreg fencing token of the caller's claim of that key. Call it in the
// transaction of the domain write, before that write, and commit only when
// it returns nil. It returns an error matching ErrStale when a larger token
// has applied the key, and ErrAlreadyApplied when this token has, in a
// transaction that committed; on either the caller must roll back. The
// transaction is still usable after a refusal (nothing failed in the
// database), so the caller may read before it rolls back.
//
// Under REPEATABLE READ or SERIALIZABLE, a holder racing another on the
// same key may get the driver's serialization failure (SQLSTATE 40001)
// instead: retry the transaction, as for any other.
func (f *Fence) Apply(ctx context.Context, tx *sql.Tx, consumer, key string, token int64) error {
	if tx == nil {
		return errors.New("fence: nil transaction")
	}
	return f.ApplyWith(ctx, sqlTx{tx}, consumer, key, token)
}

// ApplyWith is Apply in a transaction of a driver without database/sql.
// q must run its queries in the transaction of the domain write; a pool or
// a connection outside a transaction would commit the fence on its own and
// fence nothing.
func (f *Fence) ApplyWith(ctx context.Context, q Querier, consumer, key string, token int64) error {
	if consumer == "" || key == "" {
		return errors.New("fence: consumer and key must not be empty")
	}
	if token <= 0 {
		// The registry's tokens start at 1: a zero is an unset Attempt.
		return fmt.Errorf("fence: token %d: tokens are positive", token)
	}
	var applied int64
	err := q.QueryRow(ctx, f.apply, consumer, key, token).Scan(&applied)
	if err == nil {
		return nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("fence: apply %s/%s: %w", consumer, key, err)
	}
	// Refused: a token >= ours holds the row, locked by the statement
	// above until this transaction ends, so this read sees the one that
	// won.
	if err := q.QueryRow(ctx, f.current, consumer, key).Scan(&applied); err != nil {
		return fmt.Errorf("fence: read %s/%s after a refusal: %w", consumer, key, err)
	}
	if applied == token {
		return fmt.Errorf("fence: %s/%s under token %d: %w", consumer, key, token, ErrAlreadyApplied)
	}
	return &StaleError{Consumer: consumer, Key: key, Token: token, Applied: applied}
}

type sqlTx struct{ tx *sql.Tx }

func (t sqlTx) QueryRow(ctx context.Context, query string, args ...any) Row {
	return t.tx.QueryRowContext(ctx, query, args...)
}
