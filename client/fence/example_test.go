package fence_test

import (
	"context"
	"database/sql"
	"errors"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/client/fence"
)

// A consumer's handler: the ledger entry and its fence row commit together,
// and a holder that was taken over writes nothing.
func ExampleFence_Apply() {
	ctx := context.Background()
	var (
		reg *client.Client // client.New(conn)
		db  *sql.DB        // sql.Open("pgx", url), with payFence.Schema() run once
	)
	payFence, err := fence.New("payment_fence")
	if err != nil {
		panic(err)
	}
	msgID, account, amount := "pay-1", "acct-1", int64(1250)

	_, _ = reg.Once(ctx, "ledger.payments", msgID, func(ctx context.Context, a client.Attempt) ([]byte, error) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return nil, err
		}
		defer func() { _ = tx.Rollback() }()
		switch err := payFence.Apply(ctx, tx, "ledger.payments", msgID, a.Token); {
		case errors.Is(err, fence.ErrAlreadyApplied):
			return nil, nil // this claim's own entry committed earlier
		case err != nil:
			return nil, err // fence.ErrStale: a newer holder took over
		}
		if _, err := tx.ExecContext(ctx, `
			INSERT INTO ledger_entries (payment_id, account, amount_minor) VALUES ($1, $2, $3)
			ON CONFLICT (payment_id) DO UPDATE SET account = excluded.account, amount_minor = excluded.amount_minor`,
			msgID, account, amount); err != nil {
			return nil, err
		}
		return nil, tx.Commit()
	})
}
