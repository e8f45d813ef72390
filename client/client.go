package client

import (
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// Client is the typed client of the registry. It is safe for concurrent use.
type Client struct {
	rpc    idemregv1.RegistryServiceClient
	holder string
	logger *slog.Logger
	// runTimes estimates the RetryInfo of IN_PROGRESS answers.
	runTimes runTimes
	// streamGuard is set once a stream interceptor of this client exists,
	// so that the unary one need not warn that streams go unguarded.
	streamGuard atomic.Bool
	// batching is nil when every call is its own RPC; claims and completes
	// share RPCs between concurrent calls otherwise, through queue.
	batching *Batching
	queue    *coalescer
}

// ClientOption configures New.
type ClientOption func(*Client)

// WithHolder names this process in the records it claims, for diagnostics
// (at most 128 bytes). The default is DefaultHolder().
func WithHolder(name string) ClientOption { return func(c *Client) { c.holder = name } }

// WithLogger receives the warnings of Once and the interceptors about
// bookkeeping that failed after the work was done (a Complete or Release
// the registry did not take). Messages are constant and fields never hold
// results or payloads. The default discards them.
func WithLogger(l *slog.Logger) ClientOption { return func(c *Client) { c.logger = l } }

// DefaultHolder is "hostname/pid", the default holder name.
func DefaultHolder() string {
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	h := fmt.Sprintf("%s/%d", host, os.Getpid())
	if len(h) > 128 {
		h = h[len(h)-128:]
	}
	return h
}

// New returns a client of the registry reachable through conn.
func New(conn grpc.ClientConnInterface, opts ...ClientOption) *Client {
	b := DefaultBatching
	c := &Client{rpc: idemregv1.NewRegistryServiceClient(conn), holder: DefaultHolder(), batching: &b}
	for _, o := range opts {
		o(c)
	}
	if c.logger == nil {
		c.logger = slog.New(slog.DiscardHandler)
	}
	if c.batching != nil {
		c.queue = newCoalescer(c.rpc, *c.batching)
	}
	return c
}

// API returns the generated stub, for what the typed client does not cover.
// Its errors are plain statuses; FromError types them.
func (c *Client) API() idemregv1.RegistryServiceClient { return c.rpc }

// ClaimParams are the arguments of Claim.
type ClaimParams struct {
	Key
	// Fingerprint is an optional hash of the parameters, at most 64 bytes. A
	// live record with another fingerprint answers ErrFingerprintMismatch.
	Fingerprint []byte
	// Lease is how long the claim is held; zero takes the registry default.
	Lease time.Duration
	// Retention is how long the record is kept after its last lease or its
	// completion; zero takes the registry default for the kind.
	Retention time.Duration
	// Holder overrides the client's holder name for this claim.
	Holder string
	// RequestID, when set, identifies this claim across repeats: while the
	// lease it acquired is live, a Claim with the same RequestID answers
	// OutcomeAcquired with the same token, so a caller whose reply was lost
	// can repeat it. Use an unguessable value (NewRequestID) and never reuse
	// one for another claim. Once and the interceptors set one themselves.
	RequestID string
	// Wait, when positive, asks the registry to wait while another holder
	// has a live lease on the key (at most MaxWait, and never past ctx's
	// deadline): the answer comes when the key is completed
	// (OutcomeCompleted), when the lease ends or is released
	// (OutcomeAcquired), or when Wait has passed (OutcomeInProgress).
	Wait time.Duration
}

// NewRequestID returns a random request id for ClaimParams.RequestID.
func NewRequestID() string { return rand.Text() }

// Claim is the answer to a Claim.
type Claim struct {
	Outcome Outcome
	// Token is the fencing token; set when acquired.
	Token int64
	// Secret proves the claim to Complete, Release and Extend; set when
	// acquired. Only this answer carries it: keep it as private as the
	// work.
	Secret []byte
	// RetryAfter is what is left of the holder's lease; set when in progress.
	RetryAfter time.Duration
	// Record is the stored record: the caller's own when acquired, the other
	// holder's (without its token) when in progress, the completed one with
	// its Result when completed.
	Record Record
}

func optDuration(d time.Duration) *durationpb.Duration {
	if d == 0 {
		return nil
	}
	return durationpb.New(d)
}

// Claim records the key for the caller, or reports who has it and what it
// produced. Errors: ErrInvalidArgument, ErrFingerprintMismatch,
// ErrUnavailable (an *UnavailableError), ErrDeadlineExceeded, ErrCanceled.
func (c *Client) Claim(ctx context.Context, p ClaimParams) (Claim, error) {
	holder := p.Holder
	if holder == "" {
		holder = c.holder
	}
	res, err := c.route(ctx, p.request(holder))
	if err != nil {
		return Claim{}, FromError(err)
	}
	r, _ := res.(*idemregv1.ClaimResponse)
	return claimFromProto(r), nil
}

func (p ClaimParams) request(holder string) *idemregv1.ClaimRequest {
	consumer, kind, key := p.proto()
	return &idemregv1.ClaimRequest{
		Consumer: consumer, Kind: kind, Key: key,
		Fingerprint: p.Fingerprint,
		Lease:       optDuration(p.Lease),
		Retention:   optDuration(p.Retention),
		Holder:      holder,
		RequestId:   p.RequestID,
		Wait:        optDuration(p.Wait),
	}
}

func claimFromProto(res *idemregv1.ClaimResponse) Claim {
	return Claim{
		Outcome:    Outcome(res.GetOutcome()),
		Token:      res.GetToken(),
		Secret:     res.GetClaimSecret(),
		RetryAfter: res.GetRetryAfter().AsDuration(),
		Record:     recordFromProto(res.GetRecord()),
	}
}

// Fence proves a claim: its fencing token and the secret that only the
// Claim's answer carried (Claim.Fence).
type Fence struct {
	Token  int64
	Secret []byte
}

// Fence returns what Complete, Release and Extend of this claim need.
func (c Claim) Fence() Fence { return Fence{Token: c.Token, Secret: c.Secret} }

// Complete stores the result under the caller's claim and returns the
// stored record. Repeating a successful Complete with the same fence
// returns the record unchanged (the first result stays), so a caller whose
// reply was lost may retry. Errors: ErrInvalidArgument, ErrLeaseLost,
// ErrNotFound, ErrUnavailable.
func (c *Client) Complete(ctx context.Context, k Key, f Fence, r Result) (Record, error) {
	consumer, kind, key := k.proto()
	req := &idemregv1.CompleteRequest{Consumer: consumer, Kind: kind, Key: key, Token: f.Token, ClaimSecret: f.Secret, Result: r.proto()}
	res, err := c.route(ctx, req)
	if err != nil {
		return Record{}, FromError(err)
	}
	cr, _ := res.(*idemregv1.CompleteResponse)
	return recordFromProto(cr.GetRecord()), nil
}

// Release gives up an in-progress claim without a result: nothing happened,
// and the next Claim acquires at once. Errors: ErrInvalidArgument,
// ErrLeaseLost, ErrAlreadyCompleted, ErrNotFound, ErrUnavailable.
func (c *Client) Release(ctx context.Context, k Key, f Fence) (Record, error) {
	consumer, kind, key := k.proto()
	res, err := c.rpc.Release(ctx, &idemregv1.ReleaseRequest{Consumer: consumer, Kind: kind, Key: key, Token: f.Token, ClaimSecret: f.Secret})
	if err != nil {
		return Record{}, FromError(err)
	}
	return recordFromProto(res.GetRecord()), nil
}

// Extend renews the lease of an in-progress claim for lease from now (zero
// takes the registry default). Errors: ErrInvalidArgument, ErrLeaseLost,
// ErrAlreadyCompleted, ErrNotFound, ErrUnavailable.
func (c *Client) Extend(ctx context.Context, k Key, f Fence, lease time.Duration) (Record, error) {
	consumer, kind, key := k.proto()
	res, err := c.rpc.Extend(ctx, &idemregv1.ExtendRequest{Consumer: consumer, Kind: kind, Key: key, Token: f.Token, ClaimSecret: f.Secret, Lease: optDuration(lease)})
	if err != nil {
		return Record{}, FromError(err)
	}
	return recordFromProto(res.GetRecord()), nil
}

// Park parks the caller's claim with reason (1-512 bytes of printable
// UTF-8): the outcome of its work is unknown and the key must not be done
// again, as after a call to a provider without an idempotency contract
// whose answer was lost. Every later Claim answers OutcomeParked until an
// operator resolves the key. Repeating it with the same fence returns the
// parked record (the first reason stays). Errors: ErrInvalidArgument,
// ErrLeaseLost, ErrAlreadyCompleted, ErrNotFound, ErrUnavailable.
func (c *Client) Park(ctx context.Context, k Key, f Fence, reason string) (Record, error) {
	consumer, kind, key := k.proto()
	res, err := c.rpc.Park(ctx, &idemregv1.ParkRequest{Consumer: consumer, Kind: kind, Key: key, Token: f.Token, ClaimSecret: f.Secret, Reason: reason})
	if err != nil {
		return Record{}, FromError(err)
	}
	return recordFromProto(res.GetRecord()), nil
}

// Lookup returns the live record. Errors: ErrInvalidArgument, ErrNotFound,
// ErrUnavailable.
func (c *Client) Lookup(ctx context.Context, k Key) (Record, error) {
	consumer, kind, key := k.proto()
	res, err := c.rpc.Lookup(ctx, &idemregv1.LookupRequest{Consumer: consumer, Kind: kind, Key: key})
	if err != nil {
		return Record{}, FromError(err)
	}
	return recordFromProto(res.GetRecord()), nil
}
