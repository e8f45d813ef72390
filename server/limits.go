package server

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage"
)

// Limits are the bounds a request must respect and the defaults it gets;
// Bounds (below) what a peer may make the server hold before any request
// is read, which server/internal/admission enforces.
type Limits struct {
	// DefaultLease applies when a Claim or Extend gives none.
	DefaultLease time.Duration
	// MinLease and MaxLease bound a requested lease.
	MinLease, MaxLease time.Duration
	// DefaultMessageRetention and DefaultOperationRetention apply when a
	// Claim gives none, by kind.
	DefaultMessageRetention, DefaultOperationRetention time.Duration
	// MinRetention and MaxRetention bound a requested retention.
	MinRetention, MaxRetention time.Duration
	// MaxResultBytes bounds the encoded size of a stored result.
	MaxResultBytes int
	// MaxLeaseTotal bounds how long one attempt may hold a key, its Claim's
	// lease and every Extend together (storage.LeaseNotAfter); zero means
	// no bound.
	MaxLeaseTotal time.Duration
}

// Default limits, documented in docs/semantics.md.
const (
	DefaultLease              = 30 * time.Second
	DefaultMinLease           = time.Second
	DefaultMaxLease           = time.Hour
	DefaultMessageRetention   = 7 * 24 * time.Hour
	DefaultOperationRetention = 24 * time.Hour
	// DefaultMinRetention keeps every record far longer than any plausible
	// clock skew between store nodes, which token monotonicity after expiry
	// relies on (see storage.NextToken).
	DefaultMinRetention   = time.Minute
	DefaultMaxRetention   = 30 * 24 * time.Hour
	DefaultMaxResultBytes = 1 << 20
	// DefaultMaxLeaseTotal lets a holder that keeps extending work on one
	// key for a day, far beyond any one handler's plausible run, so that a
	// stuck but alive holder (a loop that heartbeats and never finishes)
	// gives the key back within a day rather than never.
	DefaultMaxLeaseTotal = 24 * time.Hour
)

// Fixed limits of the API, documented in the proto.
const (
	MaxConsumerBytes    = storage.MaxConsumerBytes
	MaxKeyBytes         = 256
	MaxFingerprintBytes = 64
	MaxHolderBytes      = 128
	MaxParkReasonBytes  = 512
	MaxRequestIDBytes   = 128
)

// DefaultLimits returns the limits used when none are configured.
func DefaultLimits() Limits {
	return Limits{
		DefaultLease:              DefaultLease,
		MinLease:                  DefaultMinLease,
		MaxLease:                  DefaultMaxLease,
		DefaultMessageRetention:   DefaultMessageRetention,
		DefaultOperationRetention: DefaultOperationRetention,
		MinRetention:              DefaultMinRetention,
		MaxRetention:              DefaultMaxRetention,
		MaxResultBytes:            DefaultMaxResultBytes,
		MaxLeaseTotal:             DefaultMaxLeaseTotal,
	}
}

// Validate reports limits that contradict each other.
func (l Limits) Validate() error {
	var errs []error
	if l.MinLease <= 0 || l.MinLease > l.MaxLease {
		errs = append(errs, fmt.Errorf("lease bounds: need 0 < min (%v) <= max (%v)", l.MinLease, l.MaxLease))
	}
	if l.DefaultLease < l.MinLease || l.DefaultLease > l.MaxLease {
		errs = append(errs, fmt.Errorf("default lease %v outside [%v, %v]", l.DefaultLease, l.MinLease, l.MaxLease))
	}
	if l.MinRetention <= 0 || l.MinRetention > l.MaxRetention {
		errs = append(errs, fmt.Errorf("retention bounds: need 0 < min (%v) <= max (%v)", l.MinRetention, l.MaxRetention))
	}
	for _, d := range []time.Duration{l.DefaultMessageRetention, l.DefaultOperationRetention} {
		if d < l.MinRetention || d > l.MaxRetention {
			errs = append(errs, fmt.Errorf("default retention %v outside [%v, %v]", d, l.MinRetention, l.MaxRetention))
		}
	}
	if l.MaxLeaseTotal < 0 || (l.MaxLeaseTotal > 0 && l.MaxLeaseTotal < l.MaxLease) {
		errs = append(errs, fmt.Errorf("max lease total %v must be at least the max lease %v (0: no bound)", l.MaxLeaseTotal, l.MaxLease))
	}
	if l.MaxResultBytes <= 0 {
		errs = append(errs, fmt.Errorf("max result bytes must be positive, got %d", l.MaxResultBytes))
	}
	return errors.Join(errs...)
}

// Policy returns the lease and retention bounds of l as the policy of
// every consumer: the base a policy file overrides.
func (l Limits) Policy() policy.Policy {
	return policy.Policy{
		Source:             policy.DefaultsSource,
		Lease:              policy.Bounds{Default: l.DefaultLease, Min: l.MinLease, Max: l.MaxLease},
		MessageRetention:   policy.Bounds{Default: l.DefaultMessageRetention, Min: l.MinRetention, Max: l.MaxRetention},
		OperationRetention: policy.Bounds{Default: l.DefaultOperationRetention, Min: l.MinRetention, Max: l.MaxRetention},
		MaxLeaseTotal:      l.MaxLeaseTotal,
	}
}

// Bounds on what a request can make the server write in a log line or a
// status (server/internal/reason; docs/operations.md, "Log and error
// bounds").
const (
	MaxEchoedFieldBytes   = reason.MaxEchoedFieldBytes
	MaxStatusMessageBytes = reason.MaxStatusMessageBytes
)

// Bounds are what anyone who can open a connection may make the server
// hold, before any credential is checked: HTTP/2 header lists, streams,
// connections, and the long-lived streams that need no credentials (health
// Watch, reflection). grpc-go's own defaults leave them unbounded (16 MiB
// of headers per stream, streams without number), which let forty health
// streams take a server from 51 MB to 407 MB. Zero fields take the
// defaults below.
//
// A call whose request never arrives keeps a goroutine and its headers
// until its connection closes, recycled at least every MaxConnectionAge
// (Keepalive); MaxPendingCalls bounds how many such calls both listeners
// hold together, whatever MaxConnections × MaxConcurrentStreams allow.
type Bounds struct {
	// MaxHeaderListSize bounds the header list of one stream (HTTP/2
	// SETTINGS_MAX_HEADER_LIST_SIZE, names and values plus 32 bytes per
	// field); a stream over it is reset before it reaches a handler
	// (DefaultMaxHeaderListSize).
	MaxHeaderListSize uint32
	// MaxConcurrentStreams bounds the streams (calls) open at once on one
	// connection; a stream beyond it is refused (REFUSED_STREAM), and gRPC
	// clients queue calls beyond it instead of sending them
	// (DefaultMaxConcurrentStreams).
	MaxConcurrentStreams uint32
	// MaxConnections bounds the connections a listener holds open at once;
	// beyond it, new connections wait in the kernel's accept queue until
	// one closes (DefaultMaxConnections). Each listener (gRPC, health) has
	// its own count.
	MaxConnections int
	// MaxPublicStreams bounds the streaming calls open at once that need
	// no credentials (health Watch and reflection), over every connection
	// and both listeners; one beyond it fails at once with
	// RESOURCE_EXHAUSTED, reason TOO_MANY_STREAMS (DefaultMaxPublicStreams).
	MaxPublicStreams int
	// ConnectionTimeout bounds a new connection's TLS and HTTP/2
	// handshakes, so that a peer that connects and sends nothing does not
	// keep a connection slot (DefaultConnectionTimeout).
	ConnectionTimeout time.Duration
	// MaxCallsPerIdentity bounds the calls of one identity in progress at
	// once, over every connection, so that one caller cannot take every
	// store slot (Config.MaxInFlight) from the others; a call beyond it
	// fails at once with RESOURCE_EXHAUSTED, reason TOO_MANY_CALLS
	// (DefaultMaxCallsPerIdentity). It applies when the server has
	// identities; anonymous callers of an open server are one caller.
	MaxCallsPerIdentity int
	// MaxHealthConnectionsPerSource bounds the connections one source
	// address holds open on the health listener; a new one beyond it is
	// closed at once, so that a flood from one source cannot take every
	// slot of MaxConnections from the kubelet's probes, which come from
	// the node's address (DefaultMaxHealthConnectionsPerSource; at most
	// MaxConnections).
	MaxHealthConnectionsPerSource int
	// MaxPendingCalls bounds the calls whose request message has not
	// arrived whole yet, over both listeners: each (gRPC, health) holds at
	// most half, so that a flood of one leaves the other its share. A call
	// beyond it fails at once, before any credential is checked, with
	// RESOURCE_EXHAUSTED, reason TOO_MANY_STREAMS
	// (DefaultMaxPendingCalls). Such a call costs its goroutine and its
	// headers (HeldCallBytes at the default header bound).
	MaxPendingCalls int
}

const (
	// DefaultMaxHeaderListSize: a call's own headers (path, content type,
	// deadline, bearer token, trace context) take well under 2 KiB; 16 KiB
	// leaves room for a caller's metadata and nothing for abuse.
	DefaultMaxHeaderListSize = 16 << 10
	// DefaultMaxConcurrentStreams: more than a client needs on one
	// connection to keep a replica's store busy (a pool holds tens of
	// connections); the bound times the header size is what one
	// connection can pin.
	DefaultMaxConcurrentStreams = 64
	// DefaultMaxConnections: a shared replica serves one connection per
	// client process behind a ClusterIP Service; 128 of them fit.
	// MaxPendingCalls bounds what their held calls pin.
	DefaultMaxConnections = 128
	// DefaultMaxHealthConnectionsPerSource: an eighth of
	// DefaultMaxConnections, so that it takes eight sources to fill the
	// health listener; a kubelet opens a connection per probe, three
	// probes at most at once.
	DefaultMaxHealthConnectionsPerSource = DefaultMaxConnections / 8
	// DefaultMaxPublicStreams: enough for the watchers and grpcurl
	// sessions of operators, far below what would matter in memory.
	DefaultMaxPublicStreams = 64
	// DefaultConnectionTimeout: a handshake on a working network takes
	// milliseconds.
	DefaultConnectionTimeout = 10 * time.Second
	// DefaultMaxCallsPerIdentity: half of DefaultMaxInFlight, so that one
	// identity at its bound leaves the other half to the rest.
	DefaultMaxCallsPerIdentity = DefaultMaxInFlight / 2
	// DefaultMaxPendingCalls: a well-behaved call sends its message with
	// its headers and is pending for microseconds, so 1024 per listener is
	// never reached by callers; at HeldCallBytes each, 2048 held calls
	// cost at most 96 MiB, under a fifth of the 512 MiB pod of deploy/
	// (without the bound, both listeners held 16,384: 797 MB).
	DefaultMaxPendingCalls = 2048
	// HeldCallBytes is the resident memory one held call costs with
	// headers at DefaultMaxHeaderListSize (a call whose headers arrived
	// and whose message never does): measured by BenchmarkHeldCalls on
	// linux/amd64 (Go 1.26, grpc-go 1.85) at 35-46 KiB (about 21 KiB of
	// heap in use and 8 KiB of goroutine stack, the rest the collector's
	// headroom), rounded up.
	HeldCallBytes = 48 << 10
)

// Smallest and largest header list sizes Validate accepts: below the
// first a call's own headers do not fit; above the second the bound is no
// bound (it is grpc-go's default).
const (
	minHeaderListSize = 1 << 10
	maxHeaderListSize = 16 << 20
)

// DefaultBounds returns the default bounds.
func DefaultBounds() Bounds {
	return Bounds{
		MaxHeaderListSize:    DefaultMaxHeaderListSize,
		MaxConcurrentStreams: DefaultMaxConcurrentStreams,
		MaxConnections:       DefaultMaxConnections,
		MaxPublicStreams:     DefaultMaxPublicStreams,
		ConnectionTimeout:    DefaultConnectionTimeout,
		MaxCallsPerIdentity:  DefaultMaxCallsPerIdentity,
		MaxPendingCalls:      DefaultMaxPendingCalls,

		MaxHealthConnectionsPerSource: DefaultMaxHealthConnectionsPerSource,
	}
}

func (b *Bounds) setDefaults() {
	d := DefaultBounds()
	if b.MaxHeaderListSize == 0 {
		b.MaxHeaderListSize = d.MaxHeaderListSize
	}
	if b.MaxConcurrentStreams == 0 {
		b.MaxConcurrentStreams = d.MaxConcurrentStreams
	}
	if b.MaxConnections == 0 {
		b.MaxConnections = d.MaxConnections
	}
	if b.MaxPublicStreams == 0 {
		b.MaxPublicStreams = d.MaxPublicStreams
	}
	if b.MaxHealthConnectionsPerSource == 0 {
		b.MaxHealthConnectionsPerSource = d.MaxHealthConnectionsPerSource
	}
	if b.ConnectionTimeout == 0 {
		b.ConnectionTimeout = d.ConnectionTimeout
	}
	if b.MaxCallsPerIdentity == 0 {
		b.MaxCallsPerIdentity = d.MaxCallsPerIdentity
	}
	if b.MaxPendingCalls == 0 {
		b.MaxPendingCalls = d.MaxPendingCalls
	}
}

// Validate reports bounds that cannot work. Zero fields are valid: they
// take the defaults.
func (b Bounds) Validate() error {
	var errs []error
	if b.MaxHeaderListSize != 0 && (b.MaxHeaderListSize < minHeaderListSize || b.MaxHeaderListSize > maxHeaderListSize) {
		errs = append(errs, fmt.Errorf("the header list bound must be between %d and %d bytes, got %d", minHeaderListSize, maxHeaderListSize, b.MaxHeaderListSize))
	}
	if b.MaxConnections < 0 {
		errs = append(errs, fmt.Errorf("the connection bound must be positive, got %d", b.MaxConnections))
	}
	if b.MaxHealthConnectionsPerSource < 0 {
		errs = append(errs, fmt.Errorf("the bound on one source's health connections must be positive, got %d", b.MaxHealthConnectionsPerSource))
	}
	if b.MaxPublicStreams < 0 {
		errs = append(errs, fmt.Errorf("the bound on streams without credentials must be positive, got %d", b.MaxPublicStreams))
	}
	if b.MaxCallsPerIdentity < 0 {
		errs = append(errs, fmt.Errorf("the bound on one identity's calls must be positive, got %d", b.MaxCallsPerIdentity))
	}
	if b.MaxPendingCalls < 0 || b.MaxPendingCalls == 1 {
		errs = append(errs, fmt.Errorf("the bound on calls waiting for their request must be at least 2 (one per listener), got %d", b.MaxPendingCalls))
	}
	if b.ConnectionTimeout < 0 {
		errs = append(errs, fmt.Errorf("the connection handshake timeout must be positive, got %v", b.ConnectionTimeout))
	}
	return errors.Join(errs...)
}
