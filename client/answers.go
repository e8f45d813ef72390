package client

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"
)

// The interceptors' answers: for each case one status, one wording and one
// error type, whichever side of the call the interceptor sits on, so that
// a caller matches them alike (errors.Is, or FromError on a status that
// crossed the wire). What the server interceptor sends its service's
// callers names no registry internals (consumers, holders, tokens); the
// client interceptor's answers go to the process that owns the key, and
// may.

// answer is the typed error of a status the interceptors build.
func answer(code codes.Code, reason, msg string, extra ...protoadapt.MessageV1) error {
	return FromStatus(newStatus(code, reason, msg, extra...))
}

func missingKeyError(fullMethod string) error {
	return answer(codes.InvalidArgument, ReasonMissingKey,
		"no idempotency key for "+fullMethod+": set one with client.WithIdempotencyKey or the idempotency-key metadata",
		&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: KeyMetadata, Description: "required"}}})
}

func invalidKey(desc string) error {
	return answer(codes.InvalidArgument, ReasonInvalidArgument, "invalid idempotency key: "+desc,
		&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: KeyMetadata, Description: desc}}})
}

// fingerprintMismatch is the answer to a key used again with other
// parameters.
func fingerprintMismatch() error {
	return answer(codes.FailedPrecondition, ReasonFingerprintMismatch,
		"the idempotency key was already used with different request parameters")
}

// registryUnavailable is the answer when the registry could not be reached
// and the interceptor fails closed: the call was not run.
func registryUnavailable(retry time.Duration, cause error) error {
	if retry <= 0 {
		retry = time.Second
	}
	err := answer(codes.Unavailable, ReasonRegistryUnavailable,
		"the idempotency registry is unavailable; the request was not run, retry later",
		&errdetails.RetryInfo{RetryDelay: durationpb.New(retry)})
	if ue := (*UnavailableError)(nil); errors.As(err, &ue) {
		ue.Cause = cause
	}
	return err
}

// keyUnsupported is the answer to a keyed streaming call.
func keyUnsupported(fullMethod, kind string) error {
	desc := "not supported on " + kind + " method " + fullMethod + ": streams are not de-duplicated; call it without an idempotency key"
	return answer(codes.InvalidArgument, ReasonKeyUnsupported,
		"idempotency key "+desc+" (the call was not run)",
		&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: KeyMetadata, Description: desc}}})
}

// unreadableResult is the answer when a completed key's stored reply does
// not decode as the call's reply. The call must not run again (its effect
// happened once already), so the caller gets an error that stays until an
// operator repairs the record. named puts the record in the error, for the
// client interceptor, whose caller owns the key.
func unreadableResult(k Key, typ string, cause error, named bool) error {
	msg := "the stored result of this idempotency key does not decode; the request was not run again: an operator must repair the record"
	if !named {
		return answer(codes.Internal, ReasonStoredResultUnreadable, msg)
	}
	st := newStatus(codes.Internal, ReasonStoredResultUnreadable,
		fmt.Sprintf("the stored result of key %q of consumer %q (%s) is a %q that does not decode (%v); the call was not run again: "+
			"an operator repairs it with idemreg admin resolve --expect-token and a result that decodes, such as --response-json (docs/operations.md, a stored result that does not decode)",
			k.Key, k.Consumer, k.Kind, typ, cause))
	info := &errdetails.ErrorInfo{Reason: ReasonStoredResultUnreadable, Domain: ErrorDomain,
		Metadata: map[string]string{"consumer": k.Consumer, "kind": k.Kind.String(), "key": k.Key, "type": typ}}
	if withInfo, err := status.New(codes.Internal, st.Message()).WithDetails(info); err == nil {
		st = withInfo
	}
	return FromStatus(st)
}

// claimAnswer turns a failed Claim of an interceptor into its answer. The
// cases that have one (in progress, parked, fingerprint mismatch, registry
// unavailable, an invalid key, the caller's deadline) get it on both
// sides. Any other refusal of the registry (a consumer the identity may
// not use, a rate limit, a quota) is a misconfiguration or an overload of
// the service's own: the client interceptor returns it typed as it is, the
// server interceptor logs it and answers INTERNAL without it.
func (c *Client) claimAnswer(ctx context.Context, server bool, method string, err error) error {
	var (
		ie *InProgressError
		pe *ParkedError
		ue *UnavailableError
		e  *Error
	)
	switch {
	case errors.As(err, &ie), errors.As(err, &pe):
		return err
	case errors.Is(err, ErrFingerprintMismatch):
		return fingerprintMismatch()
	case errors.As(err, &ue):
		c.logger.WarnContext(ctx, "idemreg: registry unavailable; the call is not run", "method", method, "error", err)
		return registryUnavailable(ue.RetryAfter, err)
	case ctx.Err() != nil:
		return contextError(ctx)
	case errors.As(err, &e) && errors.Is(err, ErrInvalidArgument):
		for _, v := range e.FieldViolations {
			if v.Field != "key" {
				c.logger.ErrorContext(ctx, "idemreg: the interceptor is misconfigured", "method", method, "error", err)
				if server {
					return answer(codes.Internal, ReasonInternal, "idempotency interceptor misconfigured")
				}
				return err
			}
		}
		desc := "invalid"
		if len(e.FieldViolations) > 0 {
			desc = e.FieldViolations[0].Description
		}
		return invalidKey(desc)
	case server:
		c.logger.ErrorContext(ctx, "idemreg: claim failed", "method", method, "error", err)
		return answer(codes.Internal, ReasonInternal, "idempotency registry error")
	default:
		return err
	}
}
