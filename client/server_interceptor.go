package client

import (
	"context"
	"errors"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// UnaryServerInterceptor gives a service's own unary RPCs Stripe-like
// idempotency. A request to a selected method M that carries the
// idempotency-key metadata K is claimed as (consumer "rpc:M" by default,
// KindOperation, K) with the request's fingerprint, and:
//
//   - Acquired: the handler runs (the lease is extended while it does); its
//     response is stored, or its error when the classifier (DefaultRetryable,
//     WithRetryable) says it is final, or the key is released for a retry
//     when it is retryable (or the handler panicked).
//   - Completed: the stored response (or stored error) is returned without
//     running the handler, with the header idempotent-replayed: true.
//   - In progress: the registry holds the duplicate until the first
//     request's outcome is stored, and it gets that response (or runs,
//     should the first one's lease end or be released), for at most
//     DefaultInterceptorWait and never past its deadline; then, or at once
//     with WithInProgressWait(0), ABORTED (reason IN_PROGRESS) with a
//     RetryInfo estimated from how long the requests took (InProgressError).
//   - Same key, other payload: FAILED_PRECONDITION (reason
//     FINGERPRINT_MISMATCH).
//   - An invalid key (longer than 256 bytes, not printable UTF-8):
//     INVALID_ARGUMENT with a BadRequest on idempotency-key.
//   - Registry unreachable: UNAVAILABLE with RetryInfo (reason
//     REGISTRY_UNAVAILABLE) without running the handler, unless
//     WithRegistryUnavailable(FailOpen).
//   - Completed, but the stored response does not decode: INTERNAL (reason
//     STORED_RESULT_UNREADABLE); the handler does not run, and the record
//     is logged for an operator to repair.
//   - No key: the request runs as it is (DefaultServerMissingKey), or with
//     WithMissingKey(MissingKeyReject) fails with INVALID_ARGUMENT.
//
// The statuses it sends carry no registry internals (consumer names,
// holders, tokens), and are UnaryClientInterceptor's, with the same codes,
// reasons and wording. Replaying a response needs its message type linked
// into the binary, as it is for any generated service. Streaming RPCs never
// pass through a unary interceptor and are not de-duplicated: it panics
// when WithMethods names one, StreamServerInterceptor refuses keyed
// streaming calls, and without that interceptor this one logs an error
// once for each service with streaming methods.
//
// Options: WithMethods, WithMethodFilter, WithConsumer, WithFingerprint,
// WithRetryable, WithMissingKey, WithRegistryUnavailable, WithLease,
// WithRetention, WithInProgressWait, WithWaitInProgress,
// WithBookkeepingTimeout.
func UnaryServerInterceptor(c *Client, opts ...InterceptorOption) grpc.UnaryServerInterceptor {
	s := interceptorSettings(DefaultServerMissingKey, opts)
	mustBeUnary("UnaryServerInterceptor", s)
	var warnings streamWarnings
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		method := info.FullMethod
		if !s.selected(method) {
			return handler(ctx, req)
		}
		warnings.check(ctx, c, s, "UnaryServerInterceptor", method)
		key, err := incomingKey(ctx)
		if err != nil {
			return nil, err
		}
		if key == "" {
			if s.missingKey == MissingKeyReject {
				return nil, missingKeyError(method)
			}
			return handler(ctx, req)
		}
		reqMsg, ok := req.(proto.Message)
		if !ok {
			return nil, status.Errorf(codes.Internal, "idempotency interceptor: %s: the request is not a protobuf message", method)
		}
		fp, err := s.fingerprint(method, reqMsg)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "idempotency interceptor: %s: fingerprinting the request: %v", method, err)
		}
		k := Key{Consumer: consumerFor(s, "rpc:", method), Kind: KindOperation, Key: key}
		cl, err := c.claim(ctx, ClaimParams{Key: k, Fingerprint: fp, Lease: s.lease, Retention: s.retention}, s)
		if err != nil {
			if errors.Is(err, ErrUnavailable) && s.unavailable == FailOpen {
				c.logger.WarnContext(ctx, "idemreg: registry unavailable; serving without it", "method", method, "error", err)
				return handler(ctx, req)
			}
			return nil, c.claimAnswer(ctx, true, method, err)
		}
		switch cl.Outcome {
		case OutcomeCompleted:
			return c.replayServer(ctx, cl.Record)
		case OutcomeAcquired:
		default:
			return nil, status.Errorf(codes.Internal, "idempotency interceptor: unexpected claim outcome %v", cl.Outcome)
		}

		var (
			resp any
			herr error
		)
		c.runClaimed(ctx, s, k, cl, func() (proto.Message, error) {
			resp, herr = handler(ctx, req)
			m, _ := resp.(proto.Message)
			return m, herr
		})
		return resp, herr
	}
}

// incomingKey returns the request's idempotency key, "" when it has none.
// Several different values are refused: which one counts would be a guess.
func incomingKey(ctx context.Context) (string, error) {
	vals := metadata.ValueFromIncomingContext(ctx, KeyMetadata)
	key := ""
	for _, v := range vals {
		switch {
		case v == "" || v == key:
		case key == "":
			key = v
		default:
			return "", invalidKey("must be given once; the request carries several different values")
		}
	}
	return key, nil
}

// replayServer is the server interceptor's replayInto: it has no reply to
// decode into, so the stored type must be linked into the binary.
func (c *Client) replayServer(ctx context.Context, rec Record) (any, error) {
	// Failing to set the header only loses the hint, not the replay.
	_ = grpc.SetHeader(ctx, metadata.Pairs(ReplayedHeader, "true"))
	r := rec.Result
	switch {
	case r == nil:
		return nil, answer(codes.Internal, ReasonInternal, "idempotency interceptor: completed record without a result")
	case r.Failure != nil:
		return nil, r.Failure.Err()
	}
	m, err := storedReply(r.Response)
	if err != nil {
		c.logger.ErrorContext(ctx, "idemreg: a stored result does not decode; the request is not run again until an operator repairs the record",
			"consumer", rec.Consumer, "kind", rec.Kind.String(), "key", rec.Key.Key, "type", r.Response.Type, "error", err)
		return nil, unreadableResult(rec.Key, r.Response.Type, err, false)
	}
	return m, nil
}
