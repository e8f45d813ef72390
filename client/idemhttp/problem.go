package idemhttp

import (
	"encoding/json"
	"math"
	"net/http"
	"strconv"
	"time"

	"google.golang.org/grpc/codes"
)

// problem is an RFC 9457 problem details object. Type is about:blank, so
// Title is the status's phrase (section 4.2.1 of the RFC); Reason, an
// extension member, is the machine-readable case: the ErrorInfo reason the
// gRPC interceptors give the same case (IDEMPOTENCY_KEY_MISSING,
// IN_PROGRESS, FINGERPRINT_MISMATCH, ...).
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	Reason string `json:"reason,omitempty"`
}

// Reasons of the middleware's own answers; the others are the registry's
// (client.Reason*).
const (
	ReasonBodyTooLarge        = "REQUEST_BODY_TOO_LARGE"
	ReasonBodyUnreadable      = "REQUEST_BODY_UNREADABLE"
	ReasonResponseNotRecorded = "RESPONSE_NOT_RECORDED"
)

// writeProblem answers status with a problem body; retryAfter, when
// positive, goes in Retry-After (whole seconds, rounded up).
func writeProblem(w http.ResponseWriter, status int, reason, detail string, retryAfter time.Duration, extra http.Header) {
	h := w.Header()
	for k, v := range extra {
		h[k] = v
	}
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(int(math.Ceil(retryAfter.Seconds()))))
	}
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(problem{
		Type: "about:blank", Title: http.StatusText(status), Status: status, Detail: detail, Reason: reason,
	})
}

// httpStatus is the HTTP status of a stored failure's gRPC code (an
// operator's resolution, or a failure a gRPC service stored): the mapping
// of google.rpc.Code's documentation.
func httpStatus(c codes.Code) int {
	switch c {
	case codes.OK:
		return http.StatusOK
	case codes.Canceled:
		return 499
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	case codes.NotFound:
		return http.StatusNotFound
	case codes.AlreadyExists, codes.Aborted:
		return http.StatusConflict
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests
	case codes.Unimplemented:
		return http.StatusNotImplemented
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	default:
		return http.StatusInternalServerError
	}
}
