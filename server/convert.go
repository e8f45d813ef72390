package server

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage"
)

func kindName(k storage.Kind) string { return idemregv1.Kind(k).String() }

func timestamp(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

// toRecord converts a stored record for a response. The token of another
// holder's live claim is withheld: tokens reach only the caller that
// acquired them, so nobody completes or releases someone else's work by
// copying a token out of a response.
func toRecord(r storage.Record, withToken bool) (*idemregv1.Record, error) {
	// The record and its four times in one allocation, not five: every
	// Claim and Complete answers a record, every batch item its own.
	b := new(recordBlock)
	out := &b.rec
	out.Consumer, out.Kind, out.Key, out.State = r.Consumer, idemregv1.Kind(r.Kind), r.Key.Key, idemregv1.State(r.State)
	out.Fingerprint, out.Attempt, out.Holder, out.ParkReason = r.Fingerprint, r.Attempt, r.Holder, r.ParkReason
	out.CreatedAt = b.time(0, r.CreatedAt)
	out.LeaseExpiresAt = b.time(1, r.LeaseExpiresAt)
	out.CompletedAt = b.time(2, r.CompletedAt)
	out.ExpiresAt = b.time(3, r.ExpiresAt)
	if withToken || r.State == storage.StateCompleted {
		out.Token = r.Token
	}
	if len(r.Result) > 0 {
		var res idemregv1.Result
		if err := proto.Unmarshal(r.Result, &res); err != nil {
			return nil, fmt.Errorf("decoding stored result of %s/%s: %w", r.Consumer, r.Key.Key, err)
		}
		out.Result = &res
	}
	return out, nil
}

// recordBlock is a Record and the times it points to, allocated together.
type recordBlock struct {
	rec   idemregv1.Record
	times [4]timestamppb.Timestamp
}

// time is t as the block's i'th time, or nil when t is zero.
func (b *recordBlock) time(i int, t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	ts := &b.times[i]
	ts.Seconds, ts.Nanos = t.Unix(), int32(t.Nanosecond())
	return ts
}

// toAttempts converts a record's history for an admin response. Its
// tokens are of ended attempts, which fence nothing any more.
func toAttempts(h []storage.Attempt) []*idemregv1.Attempt {
	if len(h) == 0 {
		return nil
	}
	out := make([]*idemregv1.Attempt, len(h))
	for i, a := range h {
		out[i] = &idemregv1.Attempt{
			Attempt:    a.Attempt,
			Token:      a.Token,
			Holder:     a.Holder,
			AcquiredAt: timestamp(a.AcquiredAt()),
			EndedAt:    timestamp(a.EndedAt),
			End:        idemregv1.AttemptEnd(a.End),
			ParkReason: a.ParkReason,
			Note:       a.Note,
		}
	}
	return out
}
