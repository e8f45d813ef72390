package postgres

import (
	"context"
	"errors"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage"
)

func TestRunRetries(t *testing.T) {
	failures := func(codes ...string) func(context.Context) error {
		n := 0
		return func(context.Context) error {
			if n < len(codes) {
				n++
				return &pgconn.PgError{Code: codes[n-1], Message: "conflict"}
			}
			return nil
		}
	}
	tests := []struct {
		name      string
		fn        func(context.Context) error
		wantErr   error  // nil: success
		wantState string // SQLSTATE kept in the chain
	}{
		{name: "SerializationFailure", fn: failures("40001", "40001")},
		{name: "Deadlock", fn: failures("40P01", "40001", "40P01")},
		{name: "CockroachRestart", fn: failures("CR000")},
		{name: "Exhausted", fn: failures("40001", "40001", "40001", "40001", "40001"), wantErr: storage.ErrUnavailable, wantState: "40001"},
		{name: "ExhaustedOnDeadlock", fn: failures("40P01", "40P01", "40P01", "40P01", "40P01"), wantErr: storage.ErrUnavailable, wantState: "40P01"},
		{name: "NotRetryable", fn: failures("23505", "23505"), wantErr: storage.ErrUnavailable, wantState: "23505"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := &Store{maxRetries: 3, logger: slog.New(slog.DiscardHandler)}
			err := s.run(t.Context(), "test", tc.fn)
			if tc.wantErr == nil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, tc.wantErr)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, tc.wantState, pgErr.Code)
		})
	}
}

func TestRunContextEnded(t *testing.T) {
	s := &Store{maxRetries: 100, logger: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(t.Context())
	err := s.run(ctx, "test", func(context.Context) error {
		cancel() // ends during the statement, which fails as a conflict
		return &pgconn.PgError{Code: "40001"}
	})
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, storage.ErrUnavailable)
}

func TestRunDetachesInternalTimeouts(t *testing.T) {
	s := &Store{maxRetries: 1, logger: slog.New(slog.DiscardHandler)}
	err := s.run(t.Context(), "test", func(context.Context) error {
		return errors.Join(errors.New("connect timeout"), context.DeadlineExceeded)
	})
	require.ErrorIs(t, err, storage.ErrUnavailable)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "the caller's deadline did not pass")
}

func TestBackoff(t *testing.T) {
	for retry := 1; retry < 64; retry++ {
		d := backoff(retry)
		require.Positive(t, d)
		require.LessOrEqual(t, d, retryMaxDelay)
	}
	require.LessOrEqual(t, backoff(1), retryBaseDelay)
}
