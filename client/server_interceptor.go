package client

import (
	"context"
	"errors"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
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
//   - In progress: ABORTED with RetryInfo (reason IN_PROGRESS), or with
//     WithWaitInProgress the outcome once the first request finishes.
//   - Same key, other payload: FAILED_PRECONDITION (reason
//     FINGERPRINT_MISMATCH).
//   - An invalid key (longer than 256 bytes, not printable UTF-8):
//     INVALID_ARGUMENT with a BadRequest on idempotency-key.
//   - Registry unreachable: UNAVAILABLE with RetryInfo (reason
//     REGISTRY_UNAVAILABLE) without running the handler, unless
//     WithRegistryUnavailable(FailOpen).
//   - No key: the request runs as it is (DefaultServerMissingKey), or with
//     WithMissingKey(MissingKeyReject) fails with INVALID_ARGUMENT.
//
// The statuses it sends carry no registry internals (consumer names,
// holders, tokens). Replaying a response needs its message type linked into
// the binary, as it is for any generated service. Streaming RPCs never pass
// through a unary interceptor.
//
// Options: WithMethods, WithMethodFilter, WithConsumer, WithFingerprint,
// WithRetryable, WithMissingKey, WithRegistryUnavailable, WithLease,
// WithRetention, WithWaitInProgress, WithBookkeepingTimeout.
func UnaryServerInterceptor(c *Client, opts ...InterceptorOption) grpc.UnaryServerInterceptor {
	s := interceptorSettings(DefaultServerMissingKey, opts)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		method := info.FullMethod
		if !s.selected(method) {
			return handler(ctx, req)
		}
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
			return nil, c.serverClaimError(ctx, method, err)
		}
		switch cl.Outcome {
		case OutcomeCompleted:
			return replayServer(ctx, cl.Record)
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

func invalidKey(desc string) error {
	return newStatus(codes.InvalidArgument, ReasonInvalidArgument, "invalid idempotency key: "+desc,
		&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: KeyMetadata, Description: desc}}}).Err()
}

// serverClaimError turns a failed Claim into the status the service's
// caller gets, without the registry's internals.
func (c *Client) serverClaimError(ctx context.Context, method string, err error) error {
	var (
		ie *InProgressError
		ue *UnavailableError
		e  *Error
	)
	var pe *ParkedError
	switch {
	case errors.As(err, &ie):
		return ie
	case errors.As(err, &pe):
		return pe
	case errors.Is(err, ErrFingerprintMismatch):
		return newStatus(codes.FailedPrecondition, ReasonFingerprintMismatch,
			"the idempotency key was already used with different request parameters").Err()
	case errors.As(err, &ue):
		c.logger.WarnContext(ctx, "idemreg: registry unavailable; refusing the request", "method", method, "error", err)
		retry := ue.RetryAfter
		if retry <= 0 {
			retry = time.Second
		}
		return newStatus(codes.Unavailable, ReasonRegistryUnavailable,
			"the idempotency registry is unavailable; the request was not run, retry later",
			&errdetails.RetryInfo{RetryDelay: durationpb.New(retry)}).Err()
	case ctx.Err() != nil:
		return status.FromContextError(ctx.Err()).Err()
	case errors.As(err, &e) && errors.Is(err, ErrInvalidArgument):
		for _, v := range e.FieldViolations {
			if v.Field != "key" {
				c.logger.ErrorContext(ctx, "idemreg: the interceptor is misconfigured", "method", method, "error", err)
				return status.Error(codes.Internal, "idempotency interceptor misconfigured")
			}
		}
		desc := "invalid"
		if len(e.FieldViolations) > 0 {
			desc = e.FieldViolations[0].Description
		}
		return invalidKey(desc)
	default:
		c.logger.ErrorContext(ctx, "idemreg: claim failed", "method", method, "error", err)
		return status.Error(codes.Internal, "idempotency registry error")
	}
}

func replayServer(ctx context.Context, rec Record) (any, error) {
	// Failing to set the header only loses the hint, not the replay.
	_ = grpc.SetHeader(ctx, metadata.Pairs(ReplayedHeader, "true"))
	r := rec.Result
	switch {
	case r == nil:
		return nil, status.Error(codes.Internal, "idempotency interceptor: completed record without a result")
	case r.Failure != nil:
		return nil, r.Failure.Err()
	}
	m, err := storedReply(r.Response)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "idempotency interceptor: %v", err)
	}
	return m, nil
}
