package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// Lease and Retention are what every target is asked for.
const (
	Lease     = 30 * time.Second
	Retention = 24 * time.Hour
)

// StaticWindow is the dial options that fix a connection's HTTP/2
// flow-control windows at n bytes, as a server's --static-window does
// its own: without them grpc-go's client too sends a bandwidth-estimating
// PING with nearly every small message it receives. Zero: none.
func StaticWindow(n int32) []grpc.DialOption {
	if n <= 0 {
		return nil
	}
	return []grpc.DialOption{grpc.WithStaticStreamWindowSize(n), grpc.WithStaticConnWindowSize(n)}
}

// Registry drives an idemreg server over gRPC, on one client connection
// (HTTP/2 multiplexes the callers), one generated-stub RPC per call: the
// -unary targets.
type Registry struct {
	conn     *grpc.ClientConn
	client   idemregv1.RegistryServiceClient
	consumer string
}

// NewRegistry connects to the server at addr with opts (StaticWindow's,
// say); calls use consumer.
func NewRegistry(addr, consumer string, opts ...grpc.DialOption) (*Registry, error) {
	conn, err := grpc.NewClient(addr, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		return nil, err
	}
	return &Registry{conn: conn, client: idemregv1.NewRegistryServiceClient(conn), consumer: consumer}, nil
}

// RegistryClient drives an idemreg server through the project's Go client
// with its defaults, as a service calling Claim and Complete the ordinary
// way would: concurrent calls share BatchClaims and BatchCompletes.
type RegistryClient struct {
	conn     *grpc.ClientConn
	client   *client.Client
	consumer string
}

// NewRegistryClient connects to the server at addr; calls use consumer.
// batching is the client's (client.DefaultBatching when zero); opts are
// the connection's.
func NewRegistryClient(addr, consumer string, batching client.Batching, opts ...grpc.DialOption) (*RegistryClient, error) {
	conn, err := grpc.NewClient(addr, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		return nil, err
	}
	return &RegistryClient{conn: conn, client: client.New(conn, client.WithHolder("bench"), client.WithBatching(batching)), consumer: consumer}, nil
}

// Claim implements Target.
func (r *RegistryClient) Claim(ctx context.Context, key string) (Outcome, Fence, error) {
	cl, err := r.client.Claim(ctx, client.ClaimParams{Key: client.Key{Consumer: r.consumer, Kind: client.KindMessage, Key: key},
		Lease: Lease, Retention: Retention})
	if err != nil {
		return 0, Fence{}, err
	}
	return Outcome(cl.Outcome), Fence{Token: cl.Token, Secret: cl.Secret}, nil
}

// Complete implements Target.
func (r *RegistryClient) Complete(ctx context.Context, key string, f Fence, result []byte) error {
	_, err := r.client.Complete(ctx, client.Key{Consumer: r.consumer, Kind: client.KindMessage, Key: key},
		client.Fence{Token: f.Token, Secret: f.Secret}, client.ResponseResult("bench.v1.Done", result))
	return err
}

// Close implements Target.
func (r *RegistryClient) Close() error { return r.conn.Close() }

// Claim implements Target.
func (r *Registry) Claim(ctx context.Context, key string) (Outcome, Fence, error) {
	res, err := r.client.Claim(ctx, &idemregv1.ClaimRequest{
		Consumer: r.consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key,
		Lease: durationpb.New(Lease), Retention: durationpb.New(Retention), Holder: "bench",
	})
	if err != nil {
		return 0, Fence{}, err
	}
	return Outcome(res.GetOutcome()), Fence{Token: res.GetToken(), Secret: res.GetClaimSecret()}, nil
}

// Complete implements Target.
func (r *Registry) Complete(ctx context.Context, key string, f Fence, result []byte) error {
	_, err := r.client.Complete(ctx, &idemregv1.CompleteRequest{
		Consumer: r.consumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key, Token: f.Token, ClaimSecret: f.Secret,
		Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "bench.v1.Done", Data: result}}},
	})
	return err
}

// Close implements Target.
func (r *Registry) Close() error { return r.conn.Close() }

// SQLInbox is the hand-written baseline: the inbox table a team would add
// to its own PostgreSQL, one conditional INSERT to claim (and a SELECT when
// it inserted nothing, to tell a replay from a key in progress), one
// conditional UPDATE to complete, at the database's default isolation
// (READ COMMITTED), one pooled connection per caller. It does none of the
// registry's lease takeover, fingerprint checks or expiry on read.
type SQLInbox struct {
	pool     *pgxpool.Pool
	consumer string
}

// sqlInboxSchema is the baseline's table.
const sqlInboxSchema = `
CREATE TABLE IF NOT EXISTS bench_inbox (
    consumer         TEXT        NOT NULL,
    key              TEXT        NOT NULL,
    state            SMALLINT    NOT NULL,
    token            BIGINT      NOT NULL,
    lease_expires_at TIMESTAMPTZ NOT NULL,
    expires_at       TIMESTAMPTZ NOT NULL,
    result           BYTEA       NULL,
    PRIMARY KEY (consumer, key)
)`

const (
	sqlInboxClaim = `
INSERT INTO bench_inbox (consumer, key, state, token, lease_expires_at, expires_at)
VALUES ($1, $2, 1, $3, now() + $4 * INTERVAL '1 microsecond', now() + $5 * INTERVAL '1 microsecond')
ON CONFLICT (consumer, key) DO NOTHING
RETURNING token`
	sqlInboxRead     = `SELECT state FROM bench_inbox WHERE consumer = $1 AND key = $2`
	sqlInboxComplete = `
UPDATE bench_inbox SET state = 2, result = $4, expires_at = now() + $5 * INTERVAL '1 microsecond'
WHERE consumer = $1 AND key = $2 AND token = $3 AND state = 1`
)

// SQLApplicationName names the sql baseline's sessions, so their CPU can be
// told from others'.
const SQLApplicationName = "idemreg-bench-sql"

// NewSQLInbox connects to databaseURL with conns connections and creates
// the table.
func NewSQLInbox(ctx context.Context, databaseURL, consumer string, conns int) (*SQLInbox, error) {
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(max(conns, 1))
	cfg.ConnConfig.RuntimeParams["application_name"] = SQLApplicationName
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, sqlInboxSchema); err != nil {
		pool.Close()
		return nil, fmt.Errorf("creating bench_inbox: %w", err)
	}
	return &SQLInbox{pool: pool, consumer: consumer}, nil
}

// Claim implements Target.
func (s *SQLInbox) Claim(ctx context.Context, key string) (Outcome, Fence, error) {
	token := rand.Int64N(1<<62) + 1
	var got int64
	err := s.pool.QueryRow(ctx, sqlInboxClaim, s.consumer, key, token, Lease.Microseconds(), (Lease + Retention).Microseconds()).Scan(&got)
	if err == nil {
		return Acquired, Fence{Token: got}, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return 0, Fence{}, err
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

// Complete implements Target.
func (s *SQLInbox) Complete(ctx context.Context, key string, f Fence, result []byte) error {
	tag, err := s.pool.Exec(ctx, sqlInboxComplete, s.consumer, key, f.Token, result, Retention.Microseconds())
	if err != nil {
		return err
	}
	if tag.RowsAffected() != 1 {
		return errors.New("complete: no in-progress row with that token")
	}
	return nil
}

// Close implements Target.
func (s *SQLInbox) Close() error {
	s.pool.Close()
	return nil
}

// Redis is the other baseline: SET NX PX to claim (and a GET when it was
// not set, to tell a replay from a key in progress), SET XX PX to
// complete, on one pooled connection per caller. SET XX is not fenced by
// the token: a holder whose lease ran out overwrites its successor.
type Redis struct {
	client   *redis.Client
	consumer string
}

// NewRedis connects to the Redis at addr with conns connections.
func NewRedis(ctx context.Context, addr, consumer string, conns int) (*Redis, error) {
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: max(conns, 1), MinIdleConns: max(conns, 1)})
	if err := c.Ping(ctx).Err(); err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("redis at %s: %w", addr, err)
	}
	return &Redis{client: c, consumer: consumer}, nil
}

func (r *Redis) key(k string) string { return "idemreg-bench:" + r.consumer + ":" + k }

var doneMark = []byte("done:")

// Claim implements Target.
func (r *Redis) Claim(ctx context.Context, key string) (Outcome, Fence, error) {
	token := rand.Int64N(1<<62) + 1
	ok, err := r.client.SetNX(ctx, r.key(key), "held:"+strconv.FormatInt(token, 10), Lease).Result()
	if err != nil {
		return 0, Fence{}, err
	}
	if ok {
		return Acquired, Fence{Token: token}, nil
	}
	v, err := r.client.Get(ctx, r.key(key)).Bytes()
	if err != nil {
		return 0, Fence{}, err
	}
	if bytes.HasPrefix(v, doneMark) {
		return Completed, Fence{}, nil
	}
	return InProgress, Fence{}, nil
}

// Complete implements Target.
func (r *Redis) Complete(ctx context.Context, key string, _ Fence, result []byte) error {
	v := append(append([]byte{}, doneMark...), result...)
	ok, err := r.client.SetXX(ctx, r.key(key), v, Retention).Result()
	if err != nil {
		return err
	}
	if !ok {
		return errors.New("complete: key gone")
	}
	return nil
}

// Close implements Target.
func (r *Redis) Close() error { return r.client.Close() }

// Cleanup deletes the keys of this consumer, so runs do not fill the
// server's memory.
func (r *Redis) Cleanup(ctx context.Context) error {
	iter := r.client.Scan(ctx, 0, r.key("*"), 10_000).Iterator()
	var batch []string
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == 10_000 {
			if err := r.client.Unlink(ctx, batch...).Err(); err != nil {
				return err
			}
			batch = batch[:0]
		}
	}
	if len(batch) > 0 {
		if err := r.client.Unlink(ctx, batch...).Err(); err != nil {
			return err
		}
	}
	return iter.Err()
}

// Floor is the floor of any gRPC service on this machine: each Claim and
// each Complete is one grpc.health.v1 Check of a bare grpc-go server (no
// interceptors, no store), on one client connection as for Registry. It
// knows no outcomes: every Claim answers Acquired, so it runs with every
// iteration a new key (a pair is two trivial calls).
type Floor struct {
	conn   *grpc.ClientConn
	health healthpb.HealthClient
}

// NewFloor connects to the bare server at addr with opts.
func NewFloor(addr string, opts ...grpc.DialOption) (*Floor, error) {
	conn, err := grpc.NewClient(addr, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		return nil, err
	}
	return &Floor{conn: conn, health: healthpb.NewHealthClient(conn)}, nil
}

// Claim implements Target.
func (f *Floor) Claim(ctx context.Context, _ string) (Outcome, Fence, error) {
	if _, err := f.health.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		return 0, Fence{}, err
	}
	return Acquired, Fence{Token: 1}, nil
}

// Complete implements Target.
func (f *Floor) Complete(ctx context.Context, _ string, _ Fence, _ []byte) error {
	_, err := f.health.Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

// Close implements Target.
func (f *Floor) Close() error { return f.conn.Close() }

// The sql baseline in batches (the sql-batch target): what a team that
// batches by hand would write, one multi-row INSERT to claim many keys
// (and one SELECT for those it did not insert), one multi-row UPDATE to
// complete them, each a statement of its own transaction.
const (
	sqlInboxClaimBatch = `
INSERT INTO bench_inbox (consumer, key, state, token, lease_expires_at, expires_at)
SELECT $1, u.k, 1, u.t, now() + $4 * INTERVAL '1 microsecond', now() + $5 * INTERVAL '1 microsecond'
FROM unnest($2::text[], $3::bigint[]) AS u(k, t)
ON CONFLICT (consumer, key) DO NOTHING
RETURNING key, token`
	sqlInboxReadBatch     = `SELECT key, state FROM bench_inbox WHERE consumer = $1 AND key = ANY($2::text[])`
	sqlInboxCompleteBatch = `
UPDATE bench_inbox AS b SET state = 2, result = $4, expires_at = now() + $5 * INTERVAL '1 microsecond'
FROM unnest($2::text[], $3::bigint[]) AS u(k, t)
WHERE b.consumer = $1 AND b.key = u.k AND b.token = u.t AND b.state = 1
RETURNING b.key`
)

// ClaimBatch implements BatchTarget.
func (s *SQLInbox) ClaimBatch(ctx context.Context, keys []string) ([]Outcome, []Fence, []error, error) {
	tokens := make([]int64, len(keys))
	for i := range tokens {
		tokens[i] = rand.Int64N(1<<62) + 1
	}
	rows, err := s.pool.Query(ctx, sqlInboxClaimBatch, s.consumer, keys, tokens, Lease.Microseconds(), (Lease + Retention).Microseconds())
	if err != nil {
		return nil, nil, nil, err
	}
	got := map[string]int64{}
	for rows.Next() {
		var k string
		var t int64
		if err := rows.Scan(&k, &t); err != nil {
			rows.Close()
			return nil, nil, nil, err
		}
		got[k] = t
	}
	if err := rows.Err(); err != nil {
		return nil, nil, nil, err
	}
	outs, fences, errs := make([]Outcome, len(keys)), make([]Fence, len(keys)), make([]error, len(keys))
	var others []string
	for i, k := range keys {
		if t, ok := got[k]; ok {
			outs[i], fences[i] = Acquired, Fence{Token: t}
		} else {
			others = append(others, k)
		}
	}
	if len(others) == 0 {
		return outs, fences, errs, nil
	}
	rows, err = s.pool.Query(ctx, sqlInboxReadBatch, s.consumer, others)
	if err != nil {
		return nil, nil, nil, err
	}
	states := map[string]int16{}
	for rows.Next() {
		var k string
		var st int16
		if err := rows.Scan(&k, &st); err != nil {
			rows.Close()
			return nil, nil, nil, err
		}
		states[k] = st
	}
	if err := rows.Err(); err != nil {
		return nil, nil, nil, err
	}
	for i, k := range keys {
		if outs[i] != 0 {
			continue
		}
		switch st, ok := states[k]; {
		case !ok:
			errs[i] = errors.New("claim: row neither inserted nor found")
		case st == 2:
			outs[i] = Completed
		default:
			outs[i] = InProgress
		}
	}
	return outs, fences, errs, nil
}

// CompleteBatch implements BatchTarget.
func (s *SQLInbox) CompleteBatch(ctx context.Context, keys []string, fences []Fence, result []byte) ([]error, error) {
	tokens := make([]int64, len(keys))
	for i, f := range fences {
		tokens[i] = f.Token
	}
	rows, err := s.pool.Query(ctx, sqlInboxCompleteBatch, s.consumer, keys, tokens, result, Retention.Microseconds())
	if err != nil {
		return nil, err
	}
	done := map[string]bool{}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			rows.Close()
			return nil, err
		}
		done[k] = true
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	errs := make([]error, len(keys))
	for i, k := range keys {
		if !done[k] {
			errs[i] = errors.New("complete: no in-progress row with that token")
		}
	}
	return errs, nil
}
