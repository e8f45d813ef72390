package client

import "time"

// Options are typed by what they configure, so that an option one entry
// point does not read cannot be passed to it: WithKind is a MessageOption
// (Once and OnceBatch), WithMessageFingerprint a OnceOption only, WithMethods
// an InterceptorOption only; WithLease and the other options every entry
// point reads are a SharedOption, which is all three.
//
//	client.UnaryServerInterceptor(c, client.WithLease(time.Minute), client.WithMethods(m)) // compiles
//	client.UnaryServerInterceptor(c, client.WithKind(client.KindMessage))                   // does not: not an InterceptorOption
//	c.OnceBatch(ctx, consumer, msgs, fn, client.WithMessageFingerprint(fp))                 // does not: each BatchMessage has its own

// OnceOption configures Once.
type OnceOption interface{ applyOnce(*settings) }

// BatchOption configures OnceBatch.
type BatchOption interface{ applyBatch(*settings) }

// InterceptorOption configures UnaryClientInterceptor and
// UnaryServerInterceptor.
type InterceptorOption interface{ applyInterceptor(*settings) }

// SharedOption configures every entry point: it is a OnceOption, a
// BatchOption and an InterceptorOption.
type SharedOption func(*settings)

func (o SharedOption) applyOnce(s *settings)        { o(s) }
func (o SharedOption) applyBatch(s *settings)       { o(s) }
func (o SharedOption) applyInterceptor(s *settings) { o(s) }

// MessageOption configures Once and OnceBatch, the message consumers.
type MessageOption func(*settings)

func (o MessageOption) applyOnce(s *settings)  { o(s) }
func (o MessageOption) applyBatch(s *settings) { o(s) }

type onceOnly func(*settings)

func (o onceOnly) applyOnce(s *settings) { o(s) }

type interceptorOnly func(*settings)

func (o interceptorOnly) applyInterceptor(s *settings) { o(s) }

// Defaults of the options.
const (
	// DefaultLease is the lease Once and the interceptors claim with. The
	// lease is extended every half lease while the work runs, so it bounds
	// how long a crashed holder blocks its key, not how long work may take.
	DefaultLease = 30 * time.Second
	// DefaultBookkeepingTimeout bounds the Complete or Release that follows
	// the work. It runs even when the caller's context has ended, so that a
	// call that succeeded just before its deadline is still recorded.
	DefaultBookkeepingTimeout = 5 * time.Second
	// DefaultClientMissingKey: UnaryClientInterceptor refuses a selected call
	// without a key.
	DefaultClientMissingKey = MissingKeyReject
	// DefaultServerMissingKey: UnaryServerInterceptor runs a request without
	// a key as it is (idempotency is the caller's choice, as with Stripe).
	DefaultServerMissingKey = MissingKeyPassThrough
	// DefaultRegistryUnavailable: when the registry cannot be reached the
	// work is not done.
	DefaultRegistryUnavailable = FailClosed
	// DefaultInterceptorWait is how long, at most, a duplicate that reaches
	// an interceptor while the first call with its key still runs waits
	// for that call's outcome (never past its own deadline) before it is
	// answered IN_PROGRESS: a service owner's callers get the first call's
	// answer without having to retry. WithInProgressWait changes it, and
	// WithInProgressWait(0) answers at once. Once and OnceBatch do not
	// wait unless asked (a message consumer's worker is better spent on
	// the next message; the broker redelivers).
	DefaultInterceptorWait = 30 * time.Second
	// DefaultInProgressRetry is the RetryInfo an IN_PROGRESS answer
	// carries when this client has not yet seen a call of the consumer run
	// to its end (see InProgressError).
	DefaultInProgressRetry = time.Second
	// MinInProgressRetry is the shortest RetryInfo of an IN_PROGRESS
	// answer, so that a fast consumer's duplicates do not spin.
	MinInProgressRetry = 50 * time.Millisecond
)

// MaxWait is the longest the registry waits in one Claim for another holder
// (ClaimRequest.wait); WithWaitInProgress asks for it, or for what is left
// of the context's deadline when that is shorter.
const MaxWait = 30 * time.Second

// MissingKeyPolicy says what an interceptor does with a selected call that
// carries no idempotency key.
type MissingKeyPolicy int

const (
	// MissingKeyReject fails the call with INVALID_ARGUMENT (reason
	// IDEMPOTENCY_KEY_MISSING, matching ErrMissingKey) without running it.
	MissingKeyReject MissingKeyPolicy = iota + 1
	// MissingKeyPassThrough runs the call as if the interceptor were absent.
	MissingKeyPassThrough
)

// UnavailablePolicy says what an interceptor does when the registry cannot
// answer its Claim (the registry or its store is down).
type UnavailablePolicy int

const (
	// FailClosed does not run the work: the caller gets UNAVAILABLE (an
	// *UnavailableError from UnaryClientInterceptor; reason
	// REGISTRY_UNAVAILABLE with a RetryInfo from UnaryServerInterceptor).
	FailClosed UnavailablePolicy = iota + 1
	// FailOpen runs the work without the registry: nothing is recorded and
	// duplicates are not detected, but the idempotency key is still
	// forwarded, so a downstream that honours it de-duplicates on its own.
	FailOpen
)

type settings struct {
	lease     time.Duration
	retention time.Duration
	// wait, when set, makes a duplicate wait for the holder's outcome,
	// for at most waitLimit in all when that is positive.
	wait               *Backoff
	waitLimit          time.Duration
	bookkeepingTimeout time.Duration

	// Once.
	kind               Kind
	messageFingerprint []byte
	resultType         string

	// Interceptors.
	consumer string
	selected func(fullMethod string) bool
	// methods is WithMethods' list, which the unary interceptors check
	// for streaming methods when they are built.
	methods     []string
	fingerprint FingerprintFunc
	retryable   func(error) bool
	missingKey  MissingKeyPolicy
	unavailable UnavailablePolicy
}

func newSettings(missingKey MissingKeyPolicy, apply func(*settings)) *settings {
	s := &settings{
		lease:              DefaultLease,
		bookkeepingTimeout: DefaultBookkeepingTimeout,
		kind:               KindMessage,
		selected:           func(string) bool { return true },
		fingerprint:        DefaultFingerprint,
		retryable:          DefaultRetryable,
		missingKey:         missingKey,
		unavailable:        DefaultRegistryUnavailable,
	}
	apply(s)
	// A lease must be positive to be extended; zero means the default, not
	// "none".
	if s.lease <= 0 {
		s.lease = DefaultLease
	}
	if s.bookkeepingTimeout <= 0 {
		s.bookkeepingTimeout = DefaultBookkeepingTimeout
	}
	return s
}

func onceSettings(opts []OnceOption) *settings {
	return newSettings(DefaultClientMissingKey, func(s *settings) {
		for _, o := range opts {
			o.applyOnce(s)
		}
	})
}

func batchSettings(opts []BatchOption) *settings {
	return newSettings(DefaultClientMissingKey, func(s *settings) {
		for _, o := range opts {
			o.applyBatch(s)
		}
	})
}

func interceptorSettings(missingKey MissingKeyPolicy, opts []InterceptorOption) *settings {
	return newSettings(missingKey, func(s *settings) {
		b := DefaultBackoff
		s.wait, s.waitLimit = &b, DefaultInterceptorWait
		for _, o := range opts {
			o.applyInterceptor(s)
		}
	})
}

// WithLease sets the lease to claim with and to extend by (default
// DefaultLease; zero or less takes the default). It must lie within the
// registry's lease bounds (1s to 1h by default). Every entry point.
func WithLease(d time.Duration) SharedOption { return func(s *settings) { s.lease = d } }

// WithRetention sets how long a record is kept after its completion (or
// its last lease); zero, the default, takes the registry's default for the
// kind: 7 days for messages, 24 hours for operations. Pick it longer than
// your broker can redeliver and your callers can retry. Every entry point.
func WithRetention(d time.Duration) SharedOption { return func(s *settings) { s.retention = d } }

// WithWaitInProgress makes a duplicate wait while another holder works on
// the key, until the key is completed (the duplicate gets the replay), taken
// over after the holder's lease ran out or was released (the duplicate runs
// the work), or the context ends: with no bound but the context's, where
// the interceptors' default waits DefaultInterceptorWait at most. Without
// any wait a duplicate fails at once with an *InProgressError (ABORTED with
// RetryInfo from the interceptors).
//
// The waiting is the registry's (ClaimRequest.wait, up to MaxWait and the
// context's deadline per Claim): it answers as soon as the holder finishes,
// with no polling delay. b spaces the Claims when a wait ends without an
// outcome (the holder still working after MaxWait, or a registry that does
// not wait); zero fields take DefaultBackoff's. OnceBatch waits only after
// running the messages it acquired, so that its own claims are not held up.
// Every entry point.
func WithWaitInProgress(b Backoff) SharedOption {
	b = b.withDefaults()
	return func(s *settings) { w := b; s.wait, s.waitLimit = &w, 0 }
}

// WithInProgressWait bounds how long a duplicate waits in all for the
// holder's outcome (and never past its context's deadline) before it gets
// an *InProgressError; zero or less answers at once, as a duplicate did
// before waiting was the interceptors' default. Without it the
// interceptors wait DefaultInterceptorWait, and Once and OnceBatch answer
// at once. The Claims of the wait are spaced as WithWaitInProgress's,
// with DefaultBackoff unless that option came first. Every entry point.
func WithInProgressWait(d time.Duration) SharedOption {
	return func(s *settings) {
		if d <= 0 {
			s.wait, s.waitLimit = nil, 0
			return
		}
		if s.wait == nil {
			b := DefaultBackoff
			s.wait = &b
		}
		s.waitLimit = d
	}
}

// WithBookkeepingTimeout bounds the Complete or Release after the work
// (default DefaultBookkeepingTimeout). Every entry point.
func WithBookkeepingTimeout(d time.Duration) SharedOption {
	return func(s *settings) { s.bookkeepingTimeout = d }
}

// WithKind sets the kind of key Once and OnceBatch claim (default
// KindMessage). The interceptors always claim operation keys.
func WithKind(k Kind) MessageOption { return func(s *settings) { s.kind = k } }

// WithMessageFingerprint claims the key with fp, a hash of the message
// content (at most 64 bytes): a redelivery with the same id but other
// content fails with ErrFingerprintMismatch instead of replaying. Once only.
func WithMessageFingerprint(fp []byte) OnceOption {
	return onceOnly(func(s *settings) { s.messageFingerprint = fp })
}

// WithResultType names the type of the data fn returns, stored with it
// (Response.Type) so that an operator reading the record knows how to
// decode it; the default is none. Once only.
func WithResultType(typ string) OnceOption {
	return onceOnly(func(s *settings) { s.resultType = typ })
}

// WithConsumer sets the registry consumer the interceptor claims keys
// under. The default is derived from the method: "call:" + the full method
// name without its leading slash for UnaryClientInterceptor, "rpc:" + the
// same for UnaryServerInterceptor, so every method has its own key space.
// A fixed consumer shares one key space between the selected methods (the
// default fingerprint, which covers the method name, keeps them apart).
// Interceptors only.
func WithConsumer(name string) InterceptorOption {
	return interceptorOnly(func(s *settings) { s.consumer = name })
}

// WithMethods selects the methods the interceptor applies to, by full name
// ("/payments.v1.PaymentService/Charge"); the others pass through. By
// default every method is selected. UnaryClientInterceptor and
// UnaryServerInterceptor panic when they are built with a method the
// binary's descriptors say is streaming: they would never see its calls.
// Interceptors only.
func WithMethods(fullMethods ...string) InterceptorOption {
	set := make(map[string]bool, len(fullMethods))
	for _, m := range fullMethods {
		set[m] = true
	}
	return interceptorOnly(func(s *settings) {
		s.selected = func(m string) bool { return set[m] }
		s.methods = append([]string(nil), fullMethods...)
	})
}

// WithMethodFilter selects the methods the interceptor applies to with a
// function of the full method name. Interceptors only.
func WithMethodFilter(selected func(fullMethod string) bool) InterceptorOption {
	return interceptorOnly(func(s *settings) { s.selected, s.methods = selected, nil })
}

// WithFingerprint replaces DefaultFingerprint, for instance to fingerprint
// only some fields of the request. Interceptors only.
func WithFingerprint(f FingerprintFunc) InterceptorOption {
	return interceptorOnly(func(s *settings) { s.fingerprint = f })
}

// WithRetryable replaces DefaultRetryable, the classifier that decides
// which errors of the call release the key for a retry (true) and which are
// stored as final and replayed to every retry (false). Interceptors only.
func WithRetryable(retryable func(err error) bool) InterceptorOption {
	return interceptorOnly(func(s *settings) { s.retryable = retryable })
}

// WithMissingKey sets the policy for a selected call without a key
// (DefaultClientMissingKey, DefaultServerMissingKey). Interceptors only.
func WithMissingKey(p MissingKeyPolicy) InterceptorOption {
	return interceptorOnly(func(s *settings) { s.missingKey = p })
}

// WithRegistryUnavailable sets what happens when the registry cannot answer
// (default DefaultRegistryUnavailable: fail closed). Interceptors only.
func WithRegistryUnavailable(p UnavailablePolicy) InterceptorOption {
	return interceptorOnly(func(s *settings) { s.unavailable = p })
}
