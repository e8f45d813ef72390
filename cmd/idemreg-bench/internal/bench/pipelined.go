package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/client"
)

// The -pipelined targets (issue 37) are a consumer's loop in which the
// Complete of message N is not waited for: it is held and sent with the
// next Claim, from whichever caller claims next, in one RPC and one store
// transaction (idemreg-pipelined, through client.Consumer) or in one
// implicit transaction of one round trip (sql-pipelined, written by hand).
// The callers are the workers of one consumer. Their Complete returns once
// the Complete is held, so a pair's latency is its Claim's: the wait for
// durability (until the next Claim, or the linger) is not in it. A
// Complete that later fails is counted, and Close reports it.

// pipelinedLinger is how long a held Complete waits for a Claim to carry
// it: client.DefaultLinger, and the same for the hand-written baseline.
const pipelinedLinger = client.DefaultLinger

// failures counts the held Completes that did not become durable.
type failures struct {
	n     atomic.Int64
	first atomic.Pointer[error]
}

func (f *failures) add(err error) {
	f.n.Add(1)
	f.first.CompareAndSwap(nil, &err)
}

func (f *failures) err() error {
	if n := f.n.Load(); n > 0 {
		return fmt.Errorf("%d held completes failed, the first: %w", n, *f.first.Load())
	}
	return nil
}

// RegistryPipelined drives an idemreg server through client.Consumer, with
// the client's defaults otherwise.
type RegistryPipelined struct {
	conn     *grpc.ClientConn
	consumer *client.Consumer
	handling sync.Map // key → *pipelinedMessage
	failed   failures
}

type pipelinedMessage struct {
	result  chan []byte
	handled chan error
}

// NewRegistryPipelined connects to the server at addr; messages are keys
// of consumer. opts are the connection's.
func NewRegistryPipelined(addr, consumer string, opts ...grpc.DialOption) (*RegistryPipelined, error) {
	conn, err := grpc.NewClient(addr, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		return nil, err
	}
	c := client.New(conn, client.WithHolder("bench"))
	return &RegistryPipelined{conn: conn, consumer: c.Consumer(consumer,
		client.WithLease(Lease), client.WithRetention(Retention), client.WithLinger(pipelinedLinger))}, nil
}

// Claim implements Target: it starts the message's Handle, whose handler
// waits for Complete's result, and returns when the claim is answered.
func (r *RegistryPipelined) Claim(ctx context.Context, key string) (Outcome, Fence, error) {
	acquired := make(chan int64, 1)
	m := &pipelinedMessage{result: make(chan []byte, 1), handled: make(chan error, 1)}
	answered := make(chan struct {
		res client.OnceResult
		err error
	}, 1)
	// Handle outlives Claim's context, which the caller cancels on return:
	// the handler runs until Complete.
	hctx := context.WithoutCancel(ctx)
	go func() {
		res, done, err := r.consumer.Handle(hctx, key, func(_ context.Context, a client.Attempt) ([]byte, error) {
			acquired <- a.Token
			return <-m.result, nil
		})
		if res.Ran {
			m.handled <- err
			go func() {
				if err := done.Err(); err != nil {
					r.failed.add(err)
				}
			}()
			return
		}
		answered <- struct {
			res client.OnceResult
			err error
		}{res, err}
	}()
	select {
	case token := <-acquired:
		r.handling.Store(key, m)
		return Acquired, Fence{Token: token}, nil
	case a := <-answered:
		var inProgress *client.InProgressError
		switch {
		case a.res.Replayed:
			return Completed, Fence{}, nil
		case errors.As(a.err, &inProgress):
			return InProgress, Fence{}, nil
		default:
			return 0, Fence{}, a.err
		}
	}
}

// Complete implements Target: it hands the handler its result and returns
// once the Complete is held.
func (r *RegistryPipelined) Complete(_ context.Context, key string, _ Fence, result []byte) error {
	v, ok := r.handling.LoadAndDelete(key)
	if !ok {
		return errors.New("complete: the key is not being handled")
	}
	m := v.(*pipelinedMessage)
	m.result <- result
	return <-m.handled
}

// Close implements Target: it sends what is held, and reports the held
// Completes that failed.
func (r *RegistryPipelined) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := r.consumer.Close(ctx)
	return errors.Join(err, r.failed.err(), r.conn.Close())
}

// SQLPipelined is the sql baseline with the same merge written by hand:
// the held Completes (one multi-row UPDATE) and the next Claim (the
// INSERT) go in one pgx batch, which PostgreSQL runs as one implicit
// transaction in one round trip; a Complete no Claim takes within the
// linger goes alone.
type SQLPipelined struct {
	*SQLInbox
	mu     sync.Mutex
	held   []heldSQLComplete
	timer  *time.Timer
	failed failures
}

type heldSQLComplete struct {
	key    string
	token  int64
	result []byte
}

// NewSQLPipelined connects to databaseURL with conns connections and
// creates the table.
func NewSQLPipelined(ctx context.Context, databaseURL, consumer string, conns int) (*SQLPipelined, error) {
	s, err := NewSQLInbox(ctx, databaseURL, consumer, conns)
	if err != nil {
		return nil, err
	}
	return &SQLPipelined{SQLInbox: s}, nil
}

// take removes every held Complete.
func (s *SQLPipelined) take() []heldSQLComplete {
	s.mu.Lock()
	defer s.mu.Unlock()
	held := s.held
	s.held = nil
	if s.timer != nil {
		s.timer.Stop()
		s.timer = nil
	}
	return held
}

// queueCompletes adds the multi-row UPDATE of held to b; every key gets
// the first's result, as every key of a run has the same one.
func (s *SQLPipelined) queueCompletes(b *pgx.Batch, held []heldSQLComplete) {
	keys, tokens := make([]string, len(held)), make([]int64, len(held))
	for i, h := range held {
		keys[i], tokens[i] = h.key, h.token
	}
	b.Queue(sqlInboxCompleteBatch, s.consumer, keys, tokens, held[0].result, Retention.Microseconds())
}

// readCompletes reads the UPDATE's answer and counts the keys it did not
// complete.
func (s *SQLPipelined) readCompletes(br pgx.BatchResults, held []heldSQLComplete) error {
	rows, err := br.Query()
	if err != nil {
		return err
	}
	n := 0
	for rows.Next() {
		n++
	}
	if err := rows.Err(); err != nil {
		return err
	}
	for range len(held) - n {
		s.failed.add(errors.New("complete: no in-progress row with that token"))
	}
	return nil
}

// Claim implements Target: the held Completes and the Claim in one
// transaction, one round trip.
func (s *SQLPipelined) Claim(ctx context.Context, key string) (Outcome, Fence, error) {
	held := s.take()
	b := &pgx.Batch{}
	if len(held) > 0 {
		s.queueCompletes(b, held)
	}
	token := rand.Int64N(1<<62) + 1
	b.Queue(sqlInboxClaim, s.consumer, key, token, Lease.Microseconds(), (Lease + Retention).Microseconds())
	br := s.pool.SendBatch(ctx, b)
	var cerr error
	if len(held) > 0 {
		cerr = s.readCompletes(br, held)
	}
	var got int64
	claimErr := br.QueryRow().Scan(&got)
	closeErr := br.Close()
	if cerr != nil || (closeErr != nil && len(held) > 0) {
		for range held {
			s.failed.add(errors.Join(cerr, closeErr))
		}
	}
	switch {
	case claimErr == nil && closeErr == nil:
		return Acquired, Fence{Token: got}, nil
	case claimErr != nil && !errors.Is(claimErr, pgx.ErrNoRows):
		return 0, Fence{}, claimErr
	case closeErr != nil:
		return 0, Fence{}, closeErr
	}
	var state int16
	if err := s.pool.QueryRow(ctx, sqlInboxRead, s.consumer, key).Scan(&state); err != nil {
		return 0, Fence{}, err
	}
	if state == 2 {
		return Completed, Fence{}, nil
	}
	return InProgress, Fence{}, nil
}

// Complete implements Target: it holds the Complete for the next Claim.
func (s *SQLPipelined) Complete(_ context.Context, key string, f Fence, result []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.held = append(s.held, heldSQLComplete{key: key, token: f.Token, result: result})
	if s.timer == nil {
		s.timer = time.AfterFunc(pipelinedLinger, s.flush)
	}
	return nil
}

// flush sends the held Completes alone.
func (s *SQLPipelined) flush() {
	held := s.take()
	if len(held) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b := &pgx.Batch{}
	s.queueCompletes(b, held)
	br := s.pool.SendBatch(ctx, b)
	err := s.readCompletes(br, held)
	if err = errors.Join(err, br.Close()); err != nil {
		for range held {
			s.failed.add(err)
		}
	}
}

// Close implements Target: it sends what is held, and reports the held
// Completes that failed.
func (s *SQLPipelined) Close() error {
	s.flush()
	err := s.failed.err()
	return errors.Join(err, s.SQLInbox.Close())
}
