package admincli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/policy"
)

// Output formats.
const (
	OutputTable = "table"
	OutputJSON  = "json"
)

// printJSON writes m as one line of protojson. protojson varies its
// spacing from build to build on purpose (so that nobody compares its
// bytes); compacting it through encoding/json makes the line stable for
// scripts and diffs, field order (the proto's) kept.
func printJSON(w io.Writer, m proto.Message) error {
	b, err := protojson.Marshal(m)
	if err != nil {
		return err
	}
	var out bytes.Buffer
	if err := json.Compact(&out, b); err != nil {
		return err
	}
	out.WriteByte('\n')
	_, err = w.Write(out.Bytes())
	return err
}

// printTable writes an answer for a person: aligned columns, states in
// words, times in UTC to the second with their distance from the store's
// clock where the answer carries it.
func printTable(w io.Writer, m proto.Message) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	switch m := m.(type) {
	case *idemregv1.ListRecordsResponse:
		now := m.GetStoreTime()
		fmt.Fprintln(tw, "CONSUMER\tKIND\tKEY\tSTATE\tATTEMPT\tTOKEN\tHOLDER\tCREATED\tEXPIRES")
		for _, lr := range m.GetRecords() {
			r := lr.GetRecord()
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%s\t%s\t%s\n", r.GetConsumer(), kindName(r.GetKind()), r.GetKey(),
				stateName(r, now), r.GetAttempt(), r.GetToken(), dash(r.GetHolder()), relative(r.GetCreatedAt(), now), relative(r.GetExpiresAt(), now))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintf(w, "%d records", len(m.GetRecords()))
		if t := m.GetNextPageToken(); t != "" {
			fmt.Fprintf(w, "; more with --page-token %s (or --all)", t)
		}
		_, err := fmt.Fprintln(w)
		return err
	case *idemregv1.InspectRecordResponse:
		now := m.GetStoreTime()
		recordRows(tw, m.GetRecord(), now)
		if !m.GetLive() {
			fmt.Fprintln(tw, "live:\tno (expired, not swept yet)")
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		return printHistory(w, m.GetHistory(), now)
	case *idemregv1.InvalidateRecordResponse:
		fmt.Fprintln(tw, "invalidated: the next Claim takes over")
		recordRows(tw, m.GetRecord(), nil)
		return tw.Flush()
	case *idemregv1.ResolveRecordResponse:
		fmt.Fprintln(tw, "resolved")
		recordRows(tw, m.GetRecord(), nil)
		if m.GetResponseChecked() {
			fmt.Fprintln(tw, "response:\tchecked against its type")
		}
		return tw.Flush()
	}
	return printJSON(w, m) // an answer with no table of its own
}

// printHistory writes a record's earlier attempts, oldest first, as the
// table under inspect's rows: who held each, from when to when, how it
// ended and the operator's note (the reason given to invalidate or
// resolve). The record's current attempt is the rows above it.
func printHistory(w io.Writer, history []*idemregv1.Attempt, now *timestamppb.Timestamp) error {
	if len(history) == 0 {
		_, err := fmt.Fprintln(w, "\nhistory: none (no earlier attempt ended by a takeover or an operator)")
		return err
	}
	fmt.Fprintf(w, "\nhistory: %d earlier attempts\n", len(history))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ATTEMPT\tTOKEN\tHOLDER\tACQUIRED\tENDED\tEND\tNOTE")
	for _, a := range history {
		var notes []string
		if pr := a.GetParkReason(); pr != "" {
			notes = append(notes, "parked: "+pr)
		}
		if n := a.GetNote(); n != "" {
			notes = append(notes, n)
		}
		note := strings.Join(notes, "; ")
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s\t%s\t%s\n", a.GetAttempt(), a.GetToken(), dash(a.GetHolder()),
			relative(a.GetAcquiredAt(), now), relative(a.GetEndedAt(), now), endName(a.GetEnd()), dash(note))
	}
	return tw.Flush()
}

// endName is how an attempt ended, in words.
func endName(e idemregv1.AttemptEnd) string {
	switch e {
	case idemregv1.AttemptEnd_ATTEMPT_END_TAKEN_OVER:
		return "taken over (its lease ended)"
	case idemregv1.AttemptEnd_ATTEMPT_END_INVALIDATED:
		return "invalidated"
	case idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_COMPLETED:
		return "resolved: completed"
	case idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_RELEASED:
		return "resolved: released"
	}
	return strings.ToLower(strings.TrimPrefix(e.String(), "ATTEMPT_END_"))
}

// recordRows writes a record as field: value rows.
func recordRows(tw io.Writer, r *idemregv1.Record, now *timestamppb.Timestamp) {
	row := func(k, v string) {
		if v != "" {
			fmt.Fprintf(tw, "%s:\t%s\n", k, v)
		}
	}
	row("consumer", r.GetConsumer())
	row("kind", kindName(r.GetKind()))
	row("key", r.GetKey())
	row("state", stateName(r, now))
	row("park reason", r.GetParkReason())
	row("attempt", fmt.Sprint(r.GetAttempt()))
	row("token", fmt.Sprint(r.GetToken()))
	row("holder", r.GetHolder())
	row("created", when(r.GetCreatedAt(), now))
	row("lease expires", when(r.GetLeaseExpiresAt(), now))
	row("completed", when(r.GetCompletedAt(), now))
	row("expires", when(r.GetExpiresAt(), now))
	if fp := r.GetFingerprint(); len(fp) > 0 {
		row("fingerprint", fmt.Sprintf("%x", fp))
	}
	switch res := r.GetResult(); {
	case res.GetResponse() != nil:
		row("result", fmt.Sprintf("response %s, %d bytes", res.GetResponse().GetType(), len(res.GetResponse().GetData())))
	case res.GetFailure() != nil:
		row("result", fmt.Sprintf("failure %s: %s", code.Code(res.GetFailure().GetCode()), res.GetFailure().GetMessage()))
	}
}

func kindName(k idemregv1.Kind) string {
	return strings.ToLower(strings.TrimPrefix(k.String(), "KIND_"))
}

// stateName is a record's state in words. An in-progress record at
// attempt 0 has no holder: an operator invalidated or released it and the
// next Claim acquires it.
func stateName(r *idemregv1.Record, now *timestamppb.Timestamp) string {
	switch r.GetState() {
	case idemregv1.State_STATE_IN_PROGRESS:
		switch {
		case r.GetAttempt() == 0:
			return "free (next Claim acquires)"
		case now != nil && r.GetLeaseExpiresAt() != nil && !r.GetLeaseExpiresAt().AsTime().After(now.AsTime()):
			return "in progress, lease expired"
		}
		return "in progress"
	case idemregv1.State_STATE_COMPLETED:
		return "completed"
	case idemregv1.State_STATE_PARKED:
		return "parked"
	}
	return strings.ToLower(strings.TrimPrefix(r.GetState().String(), "STATE_"))
}

// when is a time in UTC to the second, with its distance from now.
func when(t, now *timestamppb.Timestamp) string {
	if t == nil {
		return ""
	}
	s := t.AsTime().UTC().Format(time.DateTime) + " UTC"
	if now != nil {
		s += " (" + relative(t, now) + ")"
	}
	return s
}

// relative is t's distance from now in words ("3m ago", "in 7d"), or t
// itself without a now.
func relative(t, now *timestamppb.Timestamp) string {
	if t == nil {
		return "-"
	}
	if now == nil {
		return t.AsTime().UTC().Format(time.DateTime)
	}
	d := t.AsTime().Sub(now.AsTime())
	if d < 0 {
		return span(-d) + " ago"
	}
	return "in " + span(d)
}

// span is d in its two largest units, rounded down: "2d4h", "3m12s".
func span(d time.Duration) string {
	units := []struct {
		d    time.Duration
		name string
	}{{24 * time.Hour, "d"}, {time.Hour, "h"}, {time.Minute, "m"}, {time.Second, "s"}}
	for i, u := range units[:len(units)-1] {
		if d >= u.d {
			next := units[i+1]
			if r := (d % u.d) / next.d; r > 0 {
				return fmt.Sprintf("%d%s%d%s", d/u.d, u.name, r, next.name)
			}
			return fmt.Sprintf("%d%s", d/u.d, u.name)
		}
	}
	return fmt.Sprintf("%ds", d/time.Second)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// CallError is a call the server answered with an error, as opposed to
// flags that could not make one. Its text is the status for a person: the
// message, code, reason and metadata of its ErrorInfo, then a line per
// field violation (BadRequest) and the retry delay (RetryInfo).
type CallError struct{ Err error }

func (e *CallError) Unwrap() error { return e.Err }

func (e *CallError) Error() string {
	st, ok := status.FromError(e.Err)
	if !ok {
		return "error: " + e.Err.Error()
	}
	var b strings.Builder
	b.WriteString("error: " + st.Message())
	tags := []string{code.Code(st.Code()).String()}
	var lines []string
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			tags = append(tags, "reason "+d.GetReason())
			for _, k := range slices.Sorted(maps.Keys(d.GetMetadata())) {
				tags = append(tags, k+"="+d.GetMetadata()[k])
			}
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				if strings.Contains(st.Message(), v.GetField()+": "+v.GetDescription()) {
					continue // the message says it already
				}
				lines = append(lines, fmt.Sprintf("  field %s: %s", v.GetField(), v.GetDescription()))
			}
		case *errdetails.RetryInfo:
			lines = append(lines, "  retry after "+d.GetRetryDelay().AsDuration().String())
		case *errdetails.PreconditionFailure:
			for _, v := range d.GetViolations() {
				lines = append(lines, fmt.Sprintf("  precondition %s %s: %s", v.GetType(), v.GetSubject(), v.GetDescription()))
			}
		case error:
			lines = append(lines, "  (a detail that could not be decoded: "+d.Error()+")")
		}
	}
	b.WriteString(" (" + strings.Join(tags, ", ") + ")")
	for _, l := range lines {
		b.WriteString("\n" + l)
	}
	return b.String()
}

// errOutput is the error of an --output neither format.
var errOutput = errors.New("--output must be table or json")

// durationVar binds a duration flag read as the config file reads one
// ("7d" included): policy.DurationVar.
var durationVar = policy.DurationVar
