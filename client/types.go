package client

import (
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// Kind says what a key names.
type Kind int32

const (
	// KindMessage is a broker message id, de-duplicated by an inbox-style
	// consumer. Its records are kept 7 days by default.
	KindMessage = Kind(idemregv1.Kind_KIND_MESSAGE)
	// KindOperation is an idempotency key for an operation, such as a call to
	// a payment provider. Its records are kept 24 hours by default.
	KindOperation = Kind(idemregv1.Kind_KIND_OPERATION)
)

func (k Kind) String() string { return idemregv1.Kind(k).String() }

// State of a record.
type State int32

const (
	// StateInProgress: the holder of the current token is working on the key.
	StateInProgress = State(idemregv1.State_STATE_IN_PROGRESS)
	// StateCompleted: the record holds the result to replay.
	StateCompleted = State(idemregv1.State_STATE_COMPLETED)
	// StateParked: the key must not be done again until an operator
	// resolves it; Record.ParkReason says why.
	StateParked = State(idemregv1.State_STATE_PARKED)
)

func (s State) String() string { return idemregv1.State(s).String() }

// Outcome of a Claim.
type Outcome int32

const (
	// OutcomeAcquired: the caller owns the key now and must use Claim.Token.
	OutcomeAcquired = Outcome(idemregv1.Outcome_OUTCOME_ACQUIRED)
	// OutcomeInProgress: another holder has a live lease; retry after
	// Claim.RetryAfter.
	OutcomeInProgress = Outcome(idemregv1.Outcome_OUTCOME_IN_PROGRESS)
	// OutcomeCompleted: the work is done; Claim.Record.Result is what to
	// replay.
	OutcomeCompleted = Outcome(idemregv1.Outcome_OUTCOME_COMPLETED)
	// OutcomeParked: the key is parked; do not do the work (dead-letter or
	// skip the message). No token. Once and the interceptors turn it into
	// a *ParkedError.
	OutcomeParked = Outcome(idemregv1.Outcome_OUTCOME_PARKED)
)

func (o Outcome) String() string { return idemregv1.Outcome(o).String() }

// Key identifies a record.
type Key struct {
	// Consumer names the scope of the key, such as "billing.payment-worker":
	// 1-128 bytes of [A-Za-z0-9._:/-].
	Consumer string
	Kind     Kind
	// Key is the message id or the operation key: 1-256 bytes of printable
	// UTF-8.
	Key string
}

func (k Key) proto() (string, idemregv1.Kind, string) {
	return k.Consumer, idemregv1.Kind(k.Kind), k.Key
}

// Record is a stored key. Times are the registry store's clock.
type Record struct {
	Key
	State State
	// Fingerprint is empty when none was given.
	Fingerprint []byte
	// Token is the current fencing token. It is zero in a record of another
	// holder's live claim: tokens reach only the caller that acquired them.
	Token int64
	// Attempt counts acquisitions since the key was first claimed (or last
	// expired). Above 1, an earlier holder may have started the work.
	Attempt        int64
	Holder         string
	CreatedAt      time.Time
	LeaseExpiresAt time.Time
	// CompletedAt is zero while in progress.
	CompletedAt time.Time
	// ExpiresAt is when the record starts to count as absent.
	ExpiresAt time.Time
	// Result is set when completed.
	Result *Result
	// ParkReason is set when parked: the reason given to Park, or
	// "max_attempts reached".
	ParkReason string
}

// Result is what a completed key replays: exactly one of a response and a
// final failure.
type Result struct {
	Response *Response
	// Failure is a final error, replayed as this status.
	Failure *status.Status
}

// Response is a successful result: a type name (for a protobuf message, its
// full name) and bytes.
type Response struct {
	Type string
	Data []byte
}

// ResponseResult is a successful result.
func ResponseResult(typ string, data []byte) Result {
	return Result{Response: &Response{Type: typ, Data: data}}
}

// MessageResult is a successful result holding m in its deterministic
// encoding, typed with m's full name.
func MessageResult(m proto.Message) (Result, error) {
	data, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return Result{}, err
	}
	return ResponseResult(string(m.ProtoReflect().Descriptor().FullName()), data), nil
}

// FailureResult is a final failure, replayed as st. An OK status is stored as
// UNKNOWN: a failure always has an error code.
func FailureResult(st *status.Status) Result {
	if st.Code() == codes.OK {
		st = status.New(codes.Unknown, st.Message())
	}
	return Result{Failure: st}
}

// Err returns the stored failure as an error, or nil for a response.
func (r *Result) Err() error {
	if r == nil || r.Failure == nil {
		return nil
	}
	return r.Failure.Err()
}

func (r Result) proto() *idemregv1.Result {
	switch {
	case r.Response != nil:
		return &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: r.Response.Type, Data: r.Response.Data}}}
	case r.Failure != nil:
		p := r.Failure.Proto()
		f := &idemregv1.Failure{Code: p.GetCode(), Message: p.GetMessage()}
		for _, d := range p.GetDetails() {
			b, err := proto.MarshalOptions{Deterministic: true}.Marshal(d)
			if err == nil {
				f.Details = append(f.Details, b)
			}
		}
		return &idemregv1.Result{Outcome: &idemregv1.Result_Failure{Failure: f}}
	default:
		return nil
	}
}

func resultFromProto(p *idemregv1.Result) *Result {
	switch o := p.GetOutcome().(type) {
	case *idemregv1.Result_Response:
		return &Result{Response: &Response{Type: o.Response.GetType(), Data: o.Response.GetData()}}
	case *idemregv1.Result_Failure:
		sp := &spb.Status{Code: o.Failure.GetCode(), Message: o.Failure.GetMessage()}
		for _, b := range o.Failure.GetDetails() {
			var a anypb.Any
			if proto.Unmarshal(b, &a) == nil {
				sp.Details = append(sp.Details, &a)
			}
		}
		return &Result{Failure: status.FromProto(sp)}
	default:
		return nil
	}
}

func timeOf(ts *timestamppb.Timestamp) time.Time {
	if ts == nil {
		return time.Time{}
	}
	return ts.AsTime()
}

func recordFromProto(p *idemregv1.Record) Record {
	return Record{
		Key:            Key{Consumer: p.GetConsumer(), Kind: Kind(p.GetKind()), Key: p.GetKey()},
		State:          State(p.GetState()),
		Fingerprint:    p.GetFingerprint(),
		Token:          p.GetToken(),
		Attempt:        p.GetAttempt(),
		Holder:         p.GetHolder(),
		CreatedAt:      timeOf(p.GetCreatedAt()),
		LeaseExpiresAt: timeOf(p.GetLeaseExpiresAt()),
		CompletedAt:    timeOf(p.GetCompletedAt()),
		ExpiresAt:      timeOf(p.GetExpiresAt()),
		Result:         resultFromProto(p.GetResult()),
		ParkReason:     p.GetParkReason(),
	}
}
