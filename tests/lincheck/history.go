package lincheck

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Recorder collects a history: each call's input, output, and invocation
// and return times on one monotonic clock. It is safe for concurrent use.
type Recorder struct {
	start time.Time

	mu       sync.Mutex
	ops      []porcupine.Operation
	clients  int
	barriers []int64
}

// NewRecorder starts an empty history.
func NewRecorder() *Recorder { return &Recorder{start: time.Now()} }

// NewClient returns a fresh client id. A worker takes a new one after an
// ambiguous failure: that call stays open until the end of the history, and
// a client's calls must not overlap.
func (r *Recorder) NewClient() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.clients++
	return r.clients - 1
}

// Now is the recorder's clock, for Call and Return times.
func (r *Recorder) Now() int64 { return int64(time.Since(r.start)) }

// Add records a finished call.
func (r *Recorder) Add(client int, in Input, call int64, out Output, ret int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops = append(r.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
}

// Stats counts the calls of a history by answer.
type Stats struct {
	Calls     int
	Ambiguous int
	// MaxAmbiguousPerKey is the most ambiguous calls on one key: the
	// checker's work grows exponentially with it.
	MaxAmbiguousPerKey int
	ByStatus           map[Status]int
	Keys               int
	// Batches counts the BatchClaim and BatchComplete calls, BatchItems
	// their items (each one of Calls), SameKey the items after another on
	// their key in their batch.
	Batches, BatchItems, SameKey int
	// Waits counts the Claims that asked to wait; Woken, those of them that
	// answered completed or acquired.
	Waits, Woken int
}

func (s Stats) String() string {
	return fmt.Sprintf("%d calls on %d keys, %d ambiguous (at most %d on a key); %d acquired, %d in progress, %d completed replays, "+
		"%d ok, %d lease lost, %d not found, %d already completed, %d fingerprint mismatch, %d parked claims, %d parked refusals",
		s.Calls, s.Keys, s.Ambiguous, s.MaxAmbiguousPerKey, s.ByStatus[Acquired], s.ByStatus[InProgress], s.ByStatus[Completed],
		s.ByStatus[OK], s.ByStatus[LeaseLost], s.ByStatus[NotFound], s.ByStatus[AlreadyCompleted], s.ByStatus[FingerprintMismatch],
		s.ByStatus[Parked], s.ByStatus[ParkedRefusal]) +
		fmt.Sprintf("; %d batches of %d items (%d after another on their key); %d waiting claims, %d answered completed or acquired",
			s.Batches, s.BatchItems, s.SameKey, s.Waits, s.Woken)
}

// Barrier records that every call made so far that has not returned can
// no longer take effect: the process serving them was killed and has
// exited. An ambiguous call made before a barrier is closed there instead
// of at the end of the history, which spares the checker from trying it in
// every later position.
func (r *Recorder) Barrier() {
	now := r.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.barriers = append(r.barriers, now)
}

// History returns the recorded calls for the checker. A call that failed
// ambiguously may take effect at any time after its invocation, so it is
// open until the next barrier, or until after the last call returned, the
// way etcd's robustness tests record them. Ambiguous calls that cannot
// have had any effect are left out: a Lookup, and a Complete, Release or
// Extend with a token no Claim acquired (the model never matches it).
func (r *Recorder) History() ([]porcupine.Operation, Stats) {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := Stats{ByStatus: map[Status]int{}}
	var last int64
	acquired := map[string]map[int64]bool{}
	for _, op := range r.ops {
		last = max(last, op.Return)
		in, o := op.Input.(Input), op.Output.(Output)
		if in.Method == Claim && o.Status == Acquired {
			if acquired[in.Key] == nil {
				acquired[in.Key] = map[int64]bool{}
			}
			acquired[in.Key][o.Token] = true
		}
	}
	keys := map[string]bool{}
	batches := map[string]bool{}
	ambiguous := map[string]int{}
	out := make([]porcupine.Operation, 0, len(r.ops))
	for _, op := range r.ops {
		in, o := op.Input.(Input), op.Output.(Output)
		if o.Status == Unknown {
			if in.Method == Lookup || in.Method != Claim && !acquired[in.Key][in.Token] {
				continue
			}
			st.Ambiguous++
			ambiguous[in.Key]++
			st.MaxAmbiguousPerKey = max(st.MaxAmbiguousPerKey, ambiguous[in.Key])
			op.Return = last + 1
			for _, b := range r.barriers {
				if b >= op.Call {
					op.Return = b
					break
				}
			}
		}
		st.Calls++
		st.ByStatus[o.Status]++
		keys[in.Key] = true
		if in.Batch != "" {
			batches[in.Batch] = true
			st.BatchItems++
			if in.After > 0 {
				st.SameKey++
			}
		}
		if in.Wait > 0 {
			st.Waits++
			if o.Status == Completed || o.Status == Acquired {
				st.Woken++
			}
		}
		out = append(out, op)
	}
	st.Keys = len(keys)
	st.Batches = len(batches)
	return out, st
}

// ErrNotLinearizable is returned by Check for a history the model rejects.
var ErrNotLinearizable = errors.New("history is not linearizable")

// ErrCheckTimedOut is returned by Check when the checker ran out of time: a
// run must not pass on an unknown result.
var ErrCheckTimedOut = errors.New("linearizability check timed out")

// Check checks history against Model within timeout, one key at a time so
// that a failure names its keys. When a key's history is not linearizable,
// or its check ran out of time, it writes porcupine's HTML visualisation of
// those keys to htmlPath and their calls as JSON beside it (if htmlPath is
// not empty), and says so in the error.
func Check(history []porcupine.Operation, timeout time.Duration, htmlPath string) error {
	deadline := time.Now().Add(timeout)
	var (
		bad              []porcupine.Operation
		illegal, unknown []string
	)
	for _, part := range Model.Partition(history) {
		key := part[0].Input.(Input).Key
		res := porcupine.Unknown
		if left := time.Until(deadline); left > 0 {
			res = porcupine.CheckOperationsTimeout(Model, part, min(left, perKeyTimeout))
		}
		switch res {
		case porcupine.Illegal:
			illegal = append(illegal, key)
		case porcupine.Unknown:
			unknown = append(unknown, key)
		default:
			continue
		}
		bad = append(bad, part...)
	}
	var err error
	switch {
	case len(illegal) > 0:
		err = fmt.Errorf("%w: keys %v (and %d keys unchecked for lack of time)", ErrNotLinearizable, illegal, len(unknown))
	case len(unknown) > 0:
		err = fmt.Errorf("%w: keys %v", ErrCheckTimedOut, unknown)
	default:
		return nil
	}
	if htmlPath == "" {
		return err
	}
	if b, jerr := json.MarshalIndent(bad, "", " "); jerr == nil {
		_ = os.WriteFile(strings.TrimSuffix(htmlPath, ".html")+".json", b, 0o644)
	}
	_, info := porcupine.CheckOperationsVerbose(Model, bad, perKeyTimeout)
	if verr := porcupine.VisualizePath(Model, info, htmlPath); verr != nil {
		return fmt.Errorf("%w (writing the visualisation: %v)", err, verr)
	}
	return fmt.Errorf("%w: see %s", err, htmlPath)
}

// perKeyTimeout bounds the check of one key's history.
const perKeyTimeout = 30 * time.Second

// Classify turns an error of a registry call into the model's answer. The
// registry's definite refusals (ErrorInfo reasons LEASE_LOST,
// ALREADY_COMPLETED, FINGERPRINT_MISMATCH, PARKED, and NOT_FOUND) change
// nothing;
// UNAVAILABLE, DEADLINE_EXCEEDED, CANCELED and transport failures may have
// been applied and are Unknown. Any other code (INVALID_ARGUMENT,
// INTERNAL, ...) is a bug in the registry or the workload: unexpected is
// true.
func Classify(err error) (s Status, unexpected bool) {
	st := status.Convert(err)
	reason := ""
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			reason = info.GetReason()
		}
	}
	switch st.Code() {
	case codes.NotFound:
		return NotFound, false
	case codes.FailedPrecondition:
		switch reason {
		case "LEASE_LOST":
			return LeaseLost, false
		case "ALREADY_COMPLETED":
			return AlreadyCompleted, false
		case "FINGERPRINT_MISMATCH":
			return FingerprintMismatch, false
		case "PARKED":
			return ParkedRefusal, false
		case "CLAIM_SECRET_INVALID":
			return SecretInvalid, false
		}
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled:
		return Unknown, false
	}
	return Unknown, true
}
