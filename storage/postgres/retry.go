package postgres

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"syscall"
	"time"

	"github.com/cockroachdb/cockroach-go/v2/crdb"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemreg/idemreg/storage"
)

// SQLSTATEs the retry loop acts on.
const (
	sqlStateSerializationFailure = "40001" // PostgreSQL and CockroachDB
	sqlStateDeadlockDetected     = "40P01" // PostgreSQL
)

// run executes fn, one statement, and retries the whole statement while it
// fails with a serialization failure (40001; CR000 on old CockroachDB, which
// crdb also recognises) or a deadlock (40P01), up to the store's retry limit
// and the context's deadline, with a jittered exponential backoff between
// attempts (crdb.ExecuteCtx has none).
//
// Retrying is safe because those errors mean the statement's implicit
// transaction was rolled back: nothing was written. Other failures are not
// retried here; some of them are ambiguous (the connection broke while the
// statement's commit was in flight, or CockroachDB's 40003 "result is
// ambiguous"), and the caller sees storage.ErrUnavailable and decides. Every
// operation is built so that repeating it is harmless: a repeated Complete
// with the same token is a success that returns the stored record, a
// repeated Release of an ended lease and a repeated Extend succeed, and a
// Claim whose first attempt did land answers IN_PROGRESS until its lease
// ends.
//
// The error contract: when ctx has ended, the error satisfies errors.Is with
// ctx.Err(); any other failure wraps storage.ErrUnavailable (or, for
// SQLSTATE class 53, is a *storage.ExhaustedError) and the cause, so the
// SQLSTATE stays inspectable for logs. No SQL text is added.
func (s *Store) run(ctx context.Context, op string, fn func(context.Context) error) error {
	attempt := 0
	err := crdb.ExecuteCtx(crdb.WithMaxRetries(ctx, s.maxRetries), func(ctx context.Context, _ ...any) error {
		if attempt > 0 {
			d := backoff(attempt)
			s.logger.DebugContext(ctx, "postgres: retrying statement", "op", op, "attempt", attempt, "backoff", d)
			if err := sleep(ctx, d); err != nil {
				return err
			}
		}
		attempt++
		err := fn(ctx)
		if sqlState(err) == sqlStateDeadlockDetected {
			// crdb retries only 40001 and CR000; a PostgreSQL deadlock
			// victim was rolled back just the same.
			err = &retryableError{err: err}
		}
		return err
	})
	if err == nil {
		return nil
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		if errors.Is(err, ctxErr) {
			return fmt.Errorf("postgres %s: %w", op, err)
		}
		return fmt.Errorf("postgres %s: %w: %w", op, ctxErr, err)
	}
	return failure(op, err)
}

// failure is the answer to a statement that failed for a reason of the
// database's, not the caller's: ErrExhausted for SQLSTATE class 53
// (insufficient resources: the database's disk, memory or connections),
// which retrying at once does not cure, else ErrUnavailable. Either wraps
// the cause, whose SQLSTATE is logged, never sent.
func failure(op string, err error) error {
	code := sqlState(err)
	if r, ok := exhaustedResource(code); ok {
		return &storage.ExhaustedError{Resource: r, Detail: "postgres " + op + ": SQLSTATE " + code, Err: detachContext(err)}
	}
	if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
		// A new connection's socket: this process is at its limit.
		return &storage.ExhaustedError{Resource: storage.ResourceFileDescriptors, Detail: "postgres " + op + ": too many open files", Err: detachContext(err)}
	}
	return fmt.Errorf("%w: postgres %s: %w", storage.ErrUnavailable, op, detachContext(err))
}

// exhaustedResource is the resource a SQLSTATE of class 53 ran out of.
func exhaustedResource(code string) (storage.Resource, bool) {
	switch code {
	case "53100": // disk_full
		return storage.ResourceDisk, true
	case "53200": // out_of_memory
		return storage.ResourceMemory, true
	case "53300": // too_many_connections
		return storage.ResourceConnections, true
	}
	if strings.HasPrefix(code, "53") {
		// 53400 configuration_limit_exceeded (a lock table, say), and
		// what later versions add: memory of the server's own.
		return storage.ResourceMemory, true
	}
	return "", false
}

// backoff is the pause before the given retry (1 for the first).
func backoff(retry int) time.Duration {
	ceiling := retryMaxDelay
	if shift := retry - 1; shift < 20 {
		ceiling = min(retryMaxDelay, retryBaseDelay<<shift)
	}
	return ceiling/2 + rand.N(ceiling/2+1)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// retryableError marks an error the retry loop must retry: crdb classifies
// by the first SQLState() in the chain, and this one answers 40001. The
// original error stays in the chain.
type retryableError struct{ err error }

func (e *retryableError) Error() string    { return e.err.Error() }
func (e *retryableError) Unwrap() error    { return e.err }
func (e *retryableError) SQLState() string { return sqlStateSerializationFailure }

// errStale: a statement's pre-image was older than the row its
// conditional write saw (see Store.decided). It is retried like a
// serialization failure: nothing was written.
var errStale = &retryableError{err: errors.New("the statement's pre-image is older than the row it declined to write")}

// detachContext keeps a driver-internal timeout (a connect timeout, say)
// from passing for the caller's own deadline: when the caller's context is
// still live, an error chain holding a context error is cut there, keeping
// its text.
func detachContext(err error) error {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return errors.New(err.Error())
	}
	return err
}
