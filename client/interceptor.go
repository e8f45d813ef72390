package client

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Metadata names.
const (
	// KeyMetadata carries the idempotency key: read by UnaryServerInterceptor,
	// set by UnaryClientInterceptor on the outgoing call so a downstream with
	// its own idempotency contract de-duplicates too.
	KeyMetadata = "idempotency-key"
	// ReplayedHeader is "true" in the header of a reply that was replayed
	// from the registry instead of being produced by running the call.
	ReplayedHeader = "idempotent-replayed"
)

type keyContextKey struct{}

// WithIdempotencyKey returns a context whose outgoing calls through
// UnaryClientInterceptor use key. Choose the key for the logical operation
// ("payment:" + an operation id the caller created once and reuses on every
// retry), never for personal data: keys are stored in the clear and sent to
// the downstream. It takes precedence over an idempotency-key already in the
// outgoing metadata.
func WithIdempotencyKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyContextKey{}, key)
}

// IdempotencyKey returns the key set by WithIdempotencyKey, else the first
// idempotency-key of the outgoing metadata.
func IdempotencyKey(ctx context.Context) (string, bool) {
	if k, ok := ctx.Value(keyContextKey{}).(string); ok && k != "" {
		return k, true
	}
	// FromOutgoingContext, not ValueFromOutgoingContext: that one is new in
	// gRPC 1.85 and would be all that keeps the module's gRPC floor there.
	md, _ := metadata.FromOutgoingContext(ctx)
	if v := md.Get(KeyMetadata); len(v) > 0 && v[0] != "" {
		return v[0], true
	}
	return "", false
}

// FingerprintFunc computes the fingerprint of a call: at most 64 bytes that
// differ when the same key is used with different parameters.
type FingerprintFunc func(fullMethod string, req proto.Message) ([]byte, error)

// DefaultFingerprint is the SHA-256 of the full method name and the
// deterministic protobuf encoding of the request. Deterministic encoding is
// stable for one binary and one message definition; it is not a canonical
// form across languages or schema changes, so a retry from a client built
// with a changed request message may see ErrFingerprintMismatch. To
// fingerprint only some fields, clone the request, clear the others and
// call DefaultFingerprint on the clone.
func DefaultFingerprint(fullMethod string, req proto.Message) ([]byte, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		return nil, err
	}
	// Length-prefixed, so no method and body can pass for another pair.
	h := sha256.New()
	h.Write(binary.BigEndian.AppendUint64(nil, uint64(len(fullMethod))))
	h.Write([]byte(fullMethod))
	h.Write(b)
	return h.Sum(nil), nil
}

// DefaultRetryable is the default classifier of the interceptors: an error
// releases the key for a retry when its code is UNAVAILABLE,
// DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED or CANCELED (the call may
// not have run, or a retry may succeed), or when it carries no gRPC status
// at all (it failed on this side). Every other error (INVALID_ARGUMENT,
// FAILED_PRECONDITION such as a declined card, NOT_FOUND, INTERNAL, ...) is
// a final answer: stored and replayed to every retry of the key.
func DefaultRetryable(err error) bool {
	st, ok := status.FromError(err)
	if !ok {
		return true
	}
	switch st.Code() {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted, codes.Canceled:
		return true
	}
	return false
}

// replayed is the CallOption of Replayed.
type replayed struct {
	grpc.EmptyCallOption
	dst *bool
}

// Replayed is a CallOption that sets *dst to whether UnaryClientInterceptor
// answered the call from the registry (a replay of an earlier call with the
// same key) instead of calling the downstream. A replay also sets the
// idempotent-replayed: true header, for callers that read grpc.Header.
func Replayed(dst *bool) grpc.CallOption { return replayed{dst: dst} }

func consumerFor(s *settings, prefix, fullMethod string) string {
	if s.consumer != "" {
		return s.consumer
	}
	return prefix + strings.TrimPrefix(fullMethod, "/")
}

// UnaryClientInterceptor makes each selected outgoing unary call run once
// per idempotency key (WithIdempotencyKey, or the idempotency-key outgoing
// metadata). For a call with key K to method M it claims (consumer
// "call:M" by default, KindOperation, K) with the call's fingerprint, and:
//
//   - Acquired: forwards K in the idempotency-key metadata, makes the call
//     (extending the lease while it runs), then stores the reply, or stores
//     the error when the classifier (DefaultRetryable, WithRetryable) says it
//     is final, or releases the key when it is retryable. The call's own
//     answer is returned either way. Should the registry not take the
//     record, the reply is still returned and the failure logged: the key
//     stays claimed until its lease ends, and a retry after that calls the
//     downstream again (with the same key, so the downstream can tell).
//   - Completed: the stored reply is decoded into reply (or the stored error
//     is returned) without calling the downstream; Replayed and the
//     idempotent-replayed header tell the caller.
//   - In progress: the registry holds the duplicate until the first call's
//     outcome is stored, and it gets that outcome (or runs the call, should
//     the first one's lease end or be released), for at most
//     DefaultInterceptorWait and never past its deadline; then, or at once
//     with WithInProgressWait(0), an *InProgressError (ABORTED with a
//     RetryInfo estimated from how long the calls took).
//   - Same key, other parameters: ErrFingerprintMismatch (FAILED_PRECONDITION).
//   - Registry unreachable: an *UnavailableError with NotRun set (reason
//     REGISTRY_UNAVAILABLE, with RetryInfo): the downstream was not called
//     (WithRegistryUnavailable(FailOpen) calls it anyway).
//   - Completed, but the stored reply does not decode as reply:
//     ErrStoredResultUnreadable, naming the record; the call is not made.
//   - No key: ErrMissingKey (INVALID_ARGUMENT), or the call as it is with
//     WithMissingKey(MissingKeyPassThrough).
//
// These answers are the server interceptor's, with the same codes, reasons
// and wording. Registry calls carry none of the call's outgoing metadata.
// Streaming calls never pass through a unary interceptor and are not
// de-duplicated: it panics when WithMethods names one, and
// StreamClientInterceptor refuses keyed streaming calls.
//
// Options: WithMethods, WithMethodFilter, WithConsumer, WithFingerprint,
// WithRetryable, WithMissingKey, WithRegistryUnavailable, WithLease,
// WithRetention, WithInProgressWait, WithWaitInProgress,
// WithBookkeepingTimeout.
func UnaryClientInterceptor(c *Client, opts ...InterceptorOption) grpc.UnaryClientInterceptor {
	s := interceptorSettings(DefaultClientMissingKey, opts)
	mustBeUnary("UnaryClientInterceptor", s)
	var warnings streamWarnings
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if !s.selected(method) {
			return invoker(ctx, method, req, reply, cc, callOpts...)
		}
		warnings.check(ctx, c, s, "UnaryClientInterceptor", method)
		setReplayed(callOpts, false)
		key, ok := IdempotencyKey(ctx)
		if !ok {
			if s.missingKey == MissingKeyPassThrough {
				return invoker(ctx, method, req, reply, cc, callOpts...)
			}
			return missingKeyError(method)
		}
		reqMsg, ok1 := req.(proto.Message)
		replyMsg, ok2 := reply.(proto.Message)
		if !ok1 || !ok2 {
			return status.Errorf(codes.Internal, "idemreg: %s: the idempotency interceptor needs protobuf messages, got %T and %T", method, req, reply)
		}
		fp, err := s.fingerprint(method, reqMsg)
		if err != nil {
			return status.Errorf(codes.Internal, "idemreg: %s: fingerprinting the request: %v", method, err)
		}
		// The downstream gets the key too, so its own idempotency applies.
		md, _ := metadata.FromOutgoingContext(ctx)
		md = md.Copy()
		md.Set(KeyMetadata, key)
		callCtx := metadata.NewOutgoingContext(ctx, md)

		k := Key{Consumer: consumerFor(s, "call:", method), Kind: KindOperation, Key: key}
		cl, err := c.claim(registryContext(ctx), ClaimParams{Key: k, Fingerprint: fp, Lease: s.lease, Retention: s.retention}, s)
		if err != nil {
			if errors.Is(err, ErrUnavailable) && s.unavailable == FailOpen {
				c.logger.WarnContext(ctx, "idemreg: registry unavailable; calling without it", "method", method, "error", err)
				return invoker(callCtx, method, req, reply, cc, callOpts...)
			}
			return c.claimAnswer(ctx, false, method, err)
		}
		switch cl.Outcome {
		case OutcomeCompleted:
			return c.replayInto(ctx, cl.Record, replyMsg, callOpts)
		case OutcomeAcquired:
		default:
			return status.Errorf(codes.Internal, "idemreg: unexpected claim outcome %v", cl.Outcome)
		}

		var callErr error
		c.runClaimed(ctx, s, k, cl, func() (proto.Message, error) {
			callErr = invoker(callCtx, method, req, reply, cc, callOpts...)
			return replyMsg, callErr
		})
		return callErr
	}
}

func setReplayed(callOpts []grpc.CallOption, v bool) {
	for _, o := range callOpts {
		if r, ok := o.(replayed); ok && r.dst != nil {
			*r.dst = v
		}
	}
}

// replayInto decodes a completed record's outcome into reply: the stored
// error, or the stored reply. A reply that does not decode (another type,
// or bytes an operator stored that are not its wire format) is
// ErrStoredResultUnreadable, never a new run of the call.
func (c *Client) replayInto(ctx context.Context, rec Record, reply proto.Message, callOpts []grpc.CallOption) error {
	setReplayed(callOpts, true)
	for _, o := range callOpts {
		if h, ok := o.(grpc.HeaderCallOption); ok && h.HeaderAddr != nil {
			*h.HeaderAddr = metadata.Pairs(ReplayedHeader, "true")
		}
	}
	r := rec.Result
	switch {
	case r == nil:
		return answer(codes.Internal, ReasonInternal, "idemreg: completed record without a result")
	case r.Failure != nil:
		return r.Failure.Err()
	}
	var err error
	if want := string(reply.ProtoReflect().Descriptor().FullName()); r.Response.Type != want {
		err = fmt.Errorf("the call expects a %q", want)
	} else {
		proto.Reset(reply)
		err = proto.Unmarshal(r.Response.Data, reply)
	}
	if err != nil {
		c.logger.ErrorContext(ctx, "idemreg: a stored result does not decode; the call is not run again until an operator repairs the record",
			"consumer", rec.Consumer, "kind", rec.Kind.String(), "key", rec.Key.Key, "type", r.Response.Type, "error", err)
		return unreadableResult(rec.Key, r.Response.Type, err, true)
	}
	return nil
}

// storedReply decodes a stored response into a new message of its type, for
// the server interceptor, which has no reply value to decode into.
func storedReply(r *Response) (proto.Message, error) {
	mt, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(r.Type))
	if err != nil {
		return nil, fmt.Errorf("stored reply type %q: %w", r.Type, err)
	}
	m := mt.New().Interface()
	if err := proto.Unmarshal(r.Data, m); err != nil {
		return nil, fmt.Errorf("decoding the stored %q: %w", r.Type, err)
	}
	return m, nil
}
