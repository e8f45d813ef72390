package console

import (
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// timeView is a time as the pages show it: to the second and relative to
// the store's clock, with the exact UTC instant in the element's title
// (and datetime, from which console.js writes it in the browser's zone).
type timeView struct {
	Exact string // RFC 3339 with the store's precision, UTC
	Text  string // "2006-01-02 15:04:05 UTC"
	Rel   string // "3m12s ago", "in 45s", "now"
}

// IsZero reports a time the record does not have.
func (t timeView) IsZero() bool { return t.Exact == "" }

// when is ts as shown on a page read at the store's time now.
func when(now time.Time, ts *timestamppb.Timestamp) timeView {
	if ts == nil {
		return timeView{}
	}
	at := ts.AsTime().UTC()
	v := timeView{Exact: at.Format(time.RFC3339Nano), Text: at.Truncate(time.Second).Format("2006-01-02 15:04:05") + " UTC"}
	switch d := now.Sub(at); {
	case now.IsZero():
	case d >= time.Second:
		v.Rel = fmtDuration(d) + " ago"
	case d <= -time.Second:
		v.Rel = "in " + fmtDuration(-d)
	default:
		v.Rel = "now"
	}
	return v
}

// stateLabel is a record's state in words. A record in progress that
// nobody holds (an operator invalidated or released it, and no Claim has
// acquired it since) is said to await its next claim, not to be in
// progress.
func stateLabel(rec *idemregv1.Record, history []*idemregv1.Attempt) string {
	switch rec.GetState() {
	case idemregv1.State_STATE_PARKED:
		return "parked"
	case idemregv1.State_STATE_COMPLETED:
		return "completed"
	case idemregv1.State_STATE_IN_PROGRESS:
		switch awaitingClaim(rec, history) {
		case idemregv1.AttemptEnd_ATTEMPT_END_INVALIDATED:
			return "invalidated, awaiting the next claim"
		case idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_RELEASED:
			return "released, awaiting the next claim"
		}
		return "in progress"
	default:
		return "unknown"
	}
}

// awaitingClaim is how the last attempt of a record in progress that
// nobody holds ended (invalidated, or released by an operator), or
// ATTEMPT_END_UNSPECIFIED when someone holds it. An operator's action
// ends the lease at once, and a later Claim's lease ends after it, so
// the record is unheld while its lease ended no later than its last
// attempt did.
func awaitingClaim(rec *idemregv1.Record, history []*idemregv1.Attempt) idemregv1.AttemptEnd {
	if rec.GetState() != idemregv1.State_STATE_IN_PROGRESS || len(history) == 0 {
		return idemregv1.AttemptEnd_ATTEMPT_END_UNSPECIFIED
	}
	last := history[len(history)-1]
	switch last.GetEnd() {
	case idemregv1.AttemptEnd_ATTEMPT_END_INVALIDATED, idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_RELEASED:
		if !rec.GetLeaseExpiresAt().AsTime().After(last.GetEndedAt().AsTime()) {
			return last.GetEnd()
		}
	}
	return idemregv1.AttemptEnd_ATTEMPT_END_UNSPECIFIED
}

// stateNames are the filter's states in words.
var stateNames = map[idemregv1.State]string{
	idemregv1.State_STATE_PARKED:      "parked",
	idemregv1.State_STATE_IN_PROGRESS: "in progress",
	idemregv1.State_STATE_COMPLETED:   "completed",
}

// kindName is a kind in words.
func kindName(k idemregv1.Kind) string {
	switch k {
	case idemregv1.Kind_KIND_OPERATION:
		return "operation"
	case idemregv1.Kind_KIND_MESSAGE:
		return "message"
	}
	return k.String()
}
