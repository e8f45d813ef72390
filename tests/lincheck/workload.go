package lincheck

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// Config sizes a workload. Zero fields take the defaults.
type Config struct {
	// Clients is the number of concurrent workers (default 8).
	Clients int
	// Keys is how many keys the workers share at a time (default 3).
	Keys int
	// Rotate bounds how long a key is used (default 1s). A key moves on
	// to a fresh one soon after it is seen completed, and at the latest
	// after Rotate: a key whose token went to a call that failed
	// ambiguously stays in progress for its whole lease. Each key's
	// history is checked on its own.
	Rotate time.Duration
	// CallTimeout is the deadline of each call (default 2s).
	CallTimeout time.Duration
	// Consumer of the keys (default "lincheck").
	Consumer string
	// Seed makes the choice of calls repeatable (the interleaving is not).
	Seed uint64
	// Batch is the share of calls, in percent, that are a BatchClaim or a
	// BatchComplete of 2 to 8 items (default 5; negative: none).
	Batch int
	// Wait is the share of Claims, in percent, that wait 50 to 300 ms for
	// another holder's lease (default 10; negative: none).
	Wait int
	// ThroughClient sends the single Claims and Completes through the Go
	// client (with one RPC of each kind in flight, so that concurrent
	// ones share BatchClaims and BatchCompletes) instead of the generated
	// stub.
	ThroughClient bool
}

func (c *Config) setDefaults() {
	if c.Clients <= 0 {
		c.Clients = 8
	}
	if c.Keys <= 0 {
		c.Keys = 3
	}
	if c.Rotate <= 0 {
		c.Rotate = time.Second
	}
	if c.CallTimeout <= 0 {
		c.CallTimeout = 2 * time.Second
	}
	if c.Consumer == "" {
		c.Consumer = "lincheck"
	}
	if c.Batch == 0 {
		c.Batch = 5
	}
	if c.Wait == 0 {
		c.Wait = 10
	}
}

// leaseAndRetention are far longer than any run: the model has no clock
// (see the package doc). One hour is the registry's default maximum lease.
var leaseAndRetention = durationpb.New(time.Hour)

// Workload drives a registry with concurrent Claim, Complete, Release,
// Extend and Lookup calls on a few shared keys, BatchClaim and
// BatchComplete calls on those and on keys of their own, and Claims that
// wait, and records them: a batch as one call per item.
type Workload struct {
	cfg  Config
	rec  *Recorder
	rpc  idemregv1.RegistryServiceClient
	cl   *client.Client   // set with ThroughClient
	conn *grpc.ClientConn // nil when not a *grpc.ClientConn
	born time.Time

	mu         sync.Mutex
	slots      []slot
	seen       map[string][]int64 // tokens acquired per key, by anyone
	secrets    map[fence][]byte   // the claim secret of every acquired token
	ambiguous  map[string]int     // ambiguous calls per key
	acked      map[string]Output  // acknowledged Completes per key
	unexpected []string
	// repeats counts Claims repeated after a lost answer; recovered, those
	// of them that answered ACQUIRED.
	repeats, recovered int
}

// NewWorkload returns a workload on conn recording into rec.
func NewWorkload(conn grpc.ClientConnInterface, rec *Recorder, cfg Config) *Workload {
	cfg.setDefaults()
	cc, _ := conn.(*grpc.ClientConn)
	w := &Workload{cfg: cfg, rec: rec, rpc: idemregv1.NewRegistryServiceClient(conn), conn: cc, born: time.Now(),
		slots: make([]slot, cfg.Keys), seen: map[string][]int64{}, secrets: map[fence][]byte{}, ambiguous: map[string]int{}, acked: map[string]Output{}}
	if cfg.ThroughClient {
		// One RPC of each kind in flight, so that the workers' calls share
		// RPCs even at the few workers a run has (the default waits for 8).
		w.cl = client.New(conn, client.WithBatching(client.Batching{MaxInFlight: 1}))
	}
	return w
}

// fence names an acquired token.
type fence struct {
	key   string
	token int64
}

// forgedSecret is the claim secret of a caller that knows or guessed a
// token without having acquired it.
var forgedSecret = make([]byte, 16)

// secretOf returns the claim secret of in's token, or forgedSecret when
// the call is forged or nobody acquired the token.
func (w *Workload) secretOf(in Input) []byte {
	if in.Forged {
		return forgedSecret
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if s, ok := w.secrets[fence{in.Key, in.Token}]; ok {
		return s
	}
	return forgedSecret
}

// maxAmbiguousPerKey is how many ambiguous answers on a key make the
// workers move on to a fresh one (calls in flight may add a few more).
const maxAmbiguousPerKey = 3

// slot is one of the keys in use: its generation names it.
type slot struct {
	gen   int
	since time.Time
}

func slotKey(i, gen int) string { return fmt.Sprintf("s%d-g%d", i, gen) }

// Run runs the workers until ctx ends and waits for them. Calls in flight
// when ctx ends run to their own deadline, so stopping adds no ambiguous
// calls.
func (w *Workload) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for i := range w.cfg.Clients {
		wk := &worker{w: w, id: i, client: w.rec.NewClient(), held: map[string]int64{},
			rnd: rand.New(rand.NewPCG(w.cfg.Seed, uint64(i)))}
		wg.Go(func() { wk.run(ctx) })
	}
	wg.Wait()
}

// Unexpected lists the answers no model allows for (INVALID_ARGUMENT,
// INTERNAL, a malformed response): each is a failure of the run.
func (w *Workload) Unexpected() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.unexpected...)
}

// Repeats returns how many Claims were repeated with their request id
// after a lost answer, and how many of those answered ACQUIRED.
func (w *Workload) Repeats() (made, recovered int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.repeats, w.recovered
}

// Acknowledged returns the acknowledged Completes: key → the stored record.
func (w *Workload) Acknowledged() map[string]Output {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[string]Output, len(w.acked))
	for k, v := range w.acked {
		out[k] = v
	}
	return out
}

// Verify looks up every key with an acknowledged Complete, recording the
// Lookups in the history, and reports each one that is not completed with
// the acknowledged token and result: a lost acknowledged write.
func (w *Workload) Verify(ctx context.Context) []error {
	client := w.rec.NewClient()
	var errs []error
	for key, want := range w.Acknowledged() {
		in := Input{Method: Lookup, Key: key}
		call := w.rec.Now()
		out, err := w.call(ctx, in)
		w.rec.Add(client, in, call, out, w.rec.Now())
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("lookup %s: %v", key, err))
		case out.Status != OK || !out.Completed || out.Token != want.Token || out.Result != want.Result:
			errs = append(errs, fmt.Errorf("acknowledged Complete of %s lost: acknowledged %v, found %v", key, want, out))
		}
	}
	return errs
}

type worker struct {
	w      *Workload
	id     int
	client int
	seq    int
	rnd    *rand.Rand
	held   map[string]int64 // tokens this worker acquired and still holds
	// repeat is a Claim whose answer was lost, to be made again with its
	// request id, as a client does; repeated marks that repeat, which is
	// not repeated again.
	repeat   *Input
	repeated bool
}

func (wk *worker) run(ctx context.Context) {
	failures := 0
	for ctx.Err() == nil {
		if !wk.w.connected(ctx) {
			continue
		}
		ins := wk.nextCalls()
		call := wk.w.rec.Now()
		var (
			outs []Output
			errs []error
		)
		if ins[0].Batch == "" {
			out, err := wk.w.call(ctx, ins[0])
			outs, errs = []Output{out}, []error{err}
		} else {
			outs, errs = wk.w.callBatch(ctx, ins)
		}
		ret := wk.w.rec.Now()
		ambiguous := false
		for i, in := range ins {
			// An item after another on its key overlaps it: it is another
			// client's call, as far as the history shows.
			client := wk.client
			if in.After > 0 {
				client = wk.w.rec.NewClient()
			}
			wk.w.rec.Add(client, in, call, outs[i], ret)
			wk.observe(in, outs[i])
			if errs[i] != nil {
				wk.w.mu.Lock()
				wk.w.unexpected = append(wk.w.unexpected, fmt.Sprintf("%v: %v", in, errs[i]))
				wk.w.mu.Unlock()
			}
			ambiguous = ambiguous || outs[i].Status == Unknown
		}
		if !ambiguous {
			failures = 0
			continue
		}
		// The call stays open to the end of the history, and the worker
		// goes on as a new client. Every open call on a key multiplies the
		// orders the checker may have to try, so during an outage the
		// worker backs off: 20 ms, doubling up to a second.
		wk.client = wk.w.rec.NewClient()
		pause := min(20*time.Millisecond<<min(failures, 6), time.Second)
		failures++
		select {
		case <-ctx.Done():
		case <-time.After(pause/2 + time.Duration(wk.rnd.Int64N(int64(pause/2)))):
		}
	}
}

// connected reports whether the connection is ready; when it is not, it
// waits a little for it. A call made without a connection is never sent,
// yet would count as ambiguous: the workers do not make one.
func (w *Workload) connected(ctx context.Context) bool {
	if w.conn == nil {
		return true
	}
	st := w.conn.GetState()
	if st == connectivity.Ready {
		return true
	}
	w.conn.Connect()
	wctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	w.conn.WaitForStateChange(wctx, st)
	return false
}

// key picks one of the current keys.
func (wk *worker) key() string {
	i := wk.rnd.IntN(len(wk.w.slots))
	wk.w.mu.Lock()
	defer wk.w.mu.Unlock()
	sl := &wk.w.slots[i]
	if now := time.Now(); now.Sub(sl.since) > wk.w.cfg.Rotate {
		sl.gen, sl.since = sl.gen+1, now
	}
	return slotKey(i, sl.gen)
}

// retire moves the slot of key on to a fresh key, unless that happened
// already.
func (w *Workload) retire(key string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i := range w.slots {
		if sl := &w.slots[i]; slotKey(i, sl.gen) == key {
			sl.gen, sl.since = sl.gen+1, time.Now()
		}
	}
}

// nextCalls chooses the next call: one Input, or the items of a batch.
func (wk *worker) nextCalls() []Input {
	if wk.repeat == nil && wk.rnd.IntN(100) < wk.w.cfg.Batch {
		return wk.batch()
	}
	in := wk.next()
	if _, held := wk.held[in.Key]; in.Method == Claim && !held && !wk.repeated && wk.rnd.IntN(100) < wk.w.cfg.Wait {
		in.Wait = wk.waitFor()
	}
	return []Input{in}
}

// waitFor is the wait of a waiting Claim: 50 to 300 ms.
func (wk *worker) waitFor() time.Duration {
	return time.Duration(50+wk.rnd.IntN(251)) * time.Millisecond
}

// maxBatch is the most items in a batch the workload makes.
const maxBatch = 8

// batch chooses a BatchComplete of keys this worker holds (when it holds
// two or more, half the time), or else a BatchClaim of shared keys and
// keys of the batch's own. Now and then a key appears twice: a second
// Claim (in progress under the first item's holder), or a second Complete
// with the same token and another result (the first result stays). A
// BatchComplete may carry a foreign token too. An item on a key that
// appears once may wait.
func (wk *worker) batch() []Input {
	wk.seq++
	id := fmt.Sprintf("w%d-b%d", wk.id, wk.seq)
	n := 2 + wk.rnd.IntN(maxBatch-1)
	var ins []Input
	if len(wk.held) >= 2 && wk.rnd.IntN(2) == 0 {
		keys := make([]string, 0, len(wk.held))
		for k := range wk.held {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		wk.rnd.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
		for _, k := range keys[:min(n, len(keys))] {
			ins = append(ins, Input{Method: Complete, Key: k, Token: wk.held[k]})
		}
		if wk.rnd.IntN(3) == 0 && len(ins) < maxBatch {
			ins = append(ins, ins[wk.rnd.IntN(len(ins))])
		}
		if wk.rnd.IntN(4) == 0 && len(ins) < maxBatch {
			k := wk.key()
			_, tok, forged := wk.foreign(k)
			ins = append(ins, Input{Method: Complete, Key: k, Token: tok, Forged: forged})
		}
	} else {
		for i := range n {
			k := fmt.Sprintf("w%d-b%d-%d", wk.id, wk.seq, i)
			if wk.rnd.IntN(2) == 0 {
				k = wk.key()
			}
			if i > 0 && wk.rnd.IntN(6) == 0 {
				k = ins[wk.rnd.IntN(len(ins))].Key
			}
			in := Input{Method: Claim, Key: k, Holder: fmt.Sprintf("%s-%d", id, i+1)}
			in.RequestID = in.Holder
			switch f := wk.rnd.IntN(100); {
			case f < 75:
				in.Fingerprint = "A"
			case f < 90:
			default:
				in.Fingerprint = "B"
			}
			ins = append(ins, in)
		}
	}
	// At most two items on a key: a third one is dropped.
	seen := map[string]int{}
	kept := ins[:0]
	for _, in := range ins {
		if seen[in.Key] < 2 {
			seen[in.Key]++
			kept = append(kept, in)
		}
	}
	ins = kept
	last := map[string]int{}
	for i := range ins {
		in := &ins[i]
		in.Batch, in.Item = id, i+1
		if in.Method == Complete {
			in.Result = fmt.Sprintf("r-%s-%d", id, i+1)
		}
		if j, ok := last[in.Key]; ok {
			in.After = j + 1
			ins[j].Followed = true
		}
		last[in.Key] = i
	}
	for i := range ins {
		// A waiting item is decided again after its wait, after the items
		// after it on its key: only an item alone on its key waits.
		if in := &ins[i]; in.Method == Claim && seen[in.Key] == 1 && wk.rnd.IntN(100) < wk.w.cfg.Wait {
			if _, held := wk.held[in.Key]; !held {
				in.Wait = wk.waitFor()
			}
		}
	}
	return ins
}

// next chooses the next call: the holder of a key mostly completes,
// releases or extends it; others mostly claim and look up, and now and then
// present a token that is not theirs (a stale or a copied one, or one never
// issued) to exercise the fencing.
func (wk *worker) next() Input {
	wk.seq++
	wk.repeated = false
	if r := wk.repeat; r != nil {
		wk.repeat, wk.repeated = nil, true
		return *r
	}
	key := wk.key()
	in := Input{Key: key}
	p := wk.rnd.IntN(100)
	if tok, ok := wk.held[key]; ok {
		in.Token = tok
		switch {
		case p < 45:
			in.Method = Complete
		case p < 60:
			in.Method = Release
		case p < 72:
			in.Method = Extend
		case p < 75:
			// Now and then the outcome is unknown: park the key.
			in.Method = Park
		case p < 85:
			in.Method = Claim
		case p < 95:
			in.Method = Lookup
		default:
			in.Method, in.Token, in.Forged = wk.foreign(key)
		}
	} else {
		switch {
		case p < 55:
			in.Method = Claim
		case p < 80:
			in.Method = Lookup
		default:
			in.Method, in.Token, in.Forged = wk.foreign(key)
		}
	}
	switch in.Method {
	case Claim:
		switch f := wk.rnd.IntN(100); {
		case f < 75:
			in.Fingerprint = "A"
		case f < 90:
		default:
			in.Fingerprint = "B"
		}
		in.Holder = fmt.Sprintf("w%d-%d", wk.id, wk.seq)
		in.RequestID = in.Holder
	case Complete:
		in.Result = fmt.Sprintf("r-w%d-%d", wk.id, wk.seq)
	case Park:
		in.Reason = fmt.Sprintf("p-w%d-%d", wk.id, wk.seq)
	}
	return in
}

// foreign picks a fenced call with a token this worker does not hold: one
// acquired by anyone on the key (possibly the current one), or 1, which is
// never issued.
func (wk *worker) foreign(key string) (m Method, tok int64, forged bool) {
	m = []Method{Complete, Release, Extend, Park}[wk.rnd.IntN(4)]
	wk.w.mu.Lock()
	defer wk.w.mu.Unlock()
	seen := wk.w.seen[key]
	if len(seen) == 0 || wk.rnd.IntN(4) == 0 {
		return m, 1, true // never issued
	}
	// A copied token, with its claim's secret (a peer that was handed the
	// whole claim) or without it (one that derived or guessed the token).
	return m, seen[wk.rnd.IntN(len(seen))], wk.rnd.IntN(3) == 0
}

func (wk *worker) observe(in Input, out Output) {
	if wk.repeated {
		wk.w.mu.Lock()
		wk.w.repeats++
		if out.Status == Acquired {
			wk.w.recovered++
		}
		wk.w.mu.Unlock()
	}
	switch {
	case in.Method == Claim && out.Status == Acquired:
		wk.held[in.Key] = out.Token
		wk.w.mu.Lock()
		wk.w.seen[in.Key] = append(wk.w.seen[in.Key], out.Token)
		wk.w.mu.Unlock()
	case in.Method == Complete && out.Status == OK:
		wk.w.mu.Lock()
		wk.w.acked[in.Key] = out
		wk.w.mu.Unlock()
	case (out.Status == Completed || out.Status == Parked) && wk.rnd.IntN(3) == 0:
		// Seen completed (or parked) a few times: use a fresh key.
		wk.w.retire(in.Key)
	case out.Status == Unknown:
		if in.Method == Claim && !wk.repeated {
			// Repeated as a unary Claim, also when it was a batch item.
			r := Input{Method: Claim, Key: in.Key, Fingerprint: in.Fingerprint, Holder: in.Holder, RequestID: in.RequestID}
			wk.repeat = &r
		}
		// The checker's work on a key grows exponentially with the
		// ambiguous calls on it: spread them over fresh keys.
		wk.w.mu.Lock()
		wk.w.ambiguous[in.Key]++
		n := wk.w.ambiguous[in.Key]
		wk.w.mu.Unlock()
		if n >= maxAmbiguousPerKey {
			wk.w.retire(in.Key)
		}
	}
	if in.Method == Claim || in.Method == Lookup || wk.held[in.Key] != in.Token {
		return
	}
	// The token is done with once its work is recorded or given back, or
	// once it is refused. After an ambiguous answer it is kept: repeating
	// the call is what a real holder does, and is safe.
	if out.Status != Unknown && !(in.Method == Extend && out.Status == OK) {
		delete(wk.held, in.Key)
	}
}

// call makes one RPC. Its deadline is CallTimeout whether or not ctx has
// ended. err reports an answer the model does not allow for.
func (w *Workload) call(ctx context.Context, in Input) (Output, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.CallTimeout+in.Wait)
	defer cancel()
	c, kind := w.cfg.Consumer, idemregv1.Kind_KIND_OPERATION
	var (
		rec *idemregv1.Record
		err error
	)
	if w.cl != nil && (in.Method == Claim || in.Method == Complete) {
		return w.callClient(ctx, in)
	}
	switch in.Method {
	case Claim:
		var res *idemregv1.ClaimResponse
		res, err = w.rpc.Claim(ctx, w.claimRequest(in))
		if err == nil {
			return w.claimOutput(in, res)
		}
	case Complete:
		var res *idemregv1.CompleteResponse
		res, err = w.rpc.Complete(ctx, w.completeRequest(in))
		rec = res.GetRecord()
	case Release:
		var res *idemregv1.ReleaseResponse
		res, err = w.rpc.Release(ctx, &idemregv1.ReleaseRequest{Consumer: c, Kind: kind, Key: in.Key, Token: in.Token, ClaimSecret: w.secretOf(in)})
		rec = res.GetRecord()
	case Extend:
		var res *idemregv1.ExtendResponse
		res, err = w.rpc.Extend(ctx, &idemregv1.ExtendRequest{Consumer: c, Kind: kind, Key: in.Key, Token: in.Token, ClaimSecret: w.secretOf(in), Lease: leaseAndRetention})
		rec = res.GetRecord()
	case Park:
		var res *idemregv1.ParkResponse
		res, err = w.rpc.Park(ctx, &idemregv1.ParkRequest{Consumer: c, Kind: kind, Key: in.Key, Token: in.Token, ClaimSecret: w.secretOf(in), Reason: in.Reason})
		rec = res.GetRecord()
	case Lookup:
		var res *idemregv1.LookupResponse
		res, err = w.rpc.Lookup(ctx, &idemregv1.LookupRequest{Consumer: c, Kind: kind, Key: in.Key})
		rec = res.GetRecord()
	}
	if err != nil {
		return failed(err)
	}
	return w.recordOutput(in, Output{Status: OK}, rec)
}

// callClient makes a Claim or a Complete through the Go client.
func (w *Workload) callClient(ctx context.Context, in Input) (Output, error) {
	k := client.Key{Consumer: w.cfg.Consumer, Kind: client.KindOperation, Key: in.Key}
	if in.Method == Complete {
		rec, err := w.cl.Complete(ctx, k, client.Fence{Token: in.Token, Secret: w.secretOf(in)},
			client.ResponseResult("lincheck.Result", []byte(in.Result)))
		if err != nil {
			return failed(err)
		}
		return w.clientRecordOutput(in, Output{Status: OK}, rec)
	}
	cl, err := w.cl.Claim(ctx, client.ClaimParams{Key: k, Fingerprint: []byte(in.Fingerprint), Lease: time.Hour,
		Retention: time.Hour, Holder: in.Holder, RequestID: in.RequestID, Wait: in.Wait})
	if err != nil {
		return failed(err)
	}
	var out Output
	switch cl.Outcome {
	case client.OutcomeAcquired:
		out.Status = Acquired
		if cl.Token != cl.Record.Token {
			return Output{}, fmt.Errorf("acquired token %d, record token %d", cl.Token, cl.Record.Token)
		}
		w.mu.Lock()
		w.secrets[fence{in.Key, cl.Token}] = cl.Secret
		w.mu.Unlock()
	case client.OutcomeInProgress:
		out.Status = InProgress
		if cl.Record.Token != 0 {
			return Output{}, fmt.Errorf("in-progress answer shows the holder's token %d", cl.Record.Token)
		}
	case client.OutcomeCompleted:
		out.Status = Completed
	case client.OutcomeParked:
		out.Status = Parked
		if cl.Token != 0 || cl.Record.Token != 0 || len(cl.Secret) > 0 {
			return Output{}, fmt.Errorf("parked answer shows a token (%d, record %d) or a claim secret", cl.Token, cl.Record.Token)
		}
	default:
		return Output{}, fmt.Errorf("claim outcome %v", cl.Outcome)
	}
	return w.clientRecordOutput(in, out, cl.Record)
}

// clientRecordOutput is recordOutput for the Go client's record.
func (w *Workload) clientRecordOutput(in Input, out Output, rec client.Record) (Output, error) {
	pb := &idemregv1.Record{Consumer: rec.Consumer, Key: rec.Key.Key, Token: rec.Token, Attempt: rec.Attempt, Holder: rec.Holder,
		State: idemregv1.State(rec.State), ParkReason: rec.ParkReason}
	if r := rec.Result; r != nil && r.Response != nil {
		pb.Result = &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: r.Response.Type, Data: r.Response.Data}}}
	}
	return w.recordOutput(in, out, pb)
}

// failed is the answer of a call that returned err.
func failed(err error) (Output, error) {
	s, unexpected := Classify(err)
	if unexpected {
		return Output{Status: s}, err
	}
	return Output{Status: s}, nil
}

func (w *Workload) claimRequest(in Input) *idemregv1.ClaimRequest {
	req := &idemregv1.ClaimRequest{Consumer: w.cfg.Consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: in.Key,
		Fingerprint: []byte(in.Fingerprint), Lease: leaseAndRetention, Retention: leaseAndRetention, Holder: in.Holder,
		RequestId: in.RequestID}
	if in.Wait > 0 {
		req.Wait = durationpb.New(in.Wait)
	}
	return req
}

func (w *Workload) completeRequest(in Input) *idemregv1.CompleteRequest {
	return &idemregv1.CompleteRequest{Consumer: w.cfg.Consumer, Kind: idemregv1.Kind_KIND_OPERATION, Key: in.Key, Token: in.Token, ClaimSecret: w.secretOf(in),
		Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{
			Type: "lincheck.Result", Data: []byte(in.Result)}}}}
}

// claimOutput reads a Claim's answer, and keeps the claim secret of an
// acquired token.
func (w *Workload) claimOutput(in Input, res *idemregv1.ClaimResponse) (Output, error) {
	rec := res.GetRecord()
	var out Output
	switch res.GetOutcome() {
	case idemregv1.Outcome_OUTCOME_ACQUIRED:
		out.Status = Acquired
		if res.GetToken() != rec.GetToken() {
			return Output{}, fmt.Errorf("acquired token %d, record token %d", res.GetToken(), rec.GetToken())
		}
		w.mu.Lock()
		w.secrets[fence{in.Key, res.GetToken()}] = res.GetClaimSecret()
		w.mu.Unlock()
	case idemregv1.Outcome_OUTCOME_IN_PROGRESS:
		out.Status = InProgress
		if rec.GetToken() != 0 {
			return Output{}, fmt.Errorf("in-progress answer shows the holder's token %d", rec.GetToken())
		}
	case idemregv1.Outcome_OUTCOME_COMPLETED:
		out.Status = Completed
	case idemregv1.Outcome_OUTCOME_PARKED:
		out.Status = Parked
		if res.GetToken() != 0 || rec.GetToken() != 0 || len(res.GetClaimSecret()) > 0 {
			return Output{}, fmt.Errorf("parked answer shows a token (%d, record %d) or a claim secret", res.GetToken(), rec.GetToken())
		}
	default:
		return Output{}, fmt.Errorf("claim outcome %v", res.GetOutcome())
	}
	return w.recordOutput(in, out, rec)
}

// recordOutput completes out with the record an answer carried.
func (w *Workload) recordOutput(in Input, out Output, rec *idemregv1.Record) (Output, error) {
	if rec.GetKey() != in.Key || rec.GetConsumer() != w.cfg.Consumer {
		return Output{}, fmt.Errorf("answer for %s/%s", rec.GetConsumer(), rec.GetKey())
	}
	if out.Status == Acquired {
		out.Token = rec.GetToken()
	} else if out.Status == OK && in.Method != Lookup || rec.GetState() == idemregv1.State_STATE_COMPLETED {
		out.Token = rec.GetToken()
	}
	out.Attempt = rec.GetAttempt()
	out.Holder = rec.GetHolder()
	out.Completed = rec.GetState() == idemregv1.State_STATE_COMPLETED
	if out.Completed {
		out.Result = string(rec.GetResult().GetResponse().GetData())
	}
	out.Parked = rec.GetState() == idemregv1.State_STATE_PARKED
	out.Reason = rec.GetParkReason()
	return out, nil
}

// callBatch makes one BatchClaim (every item a Claim) or BatchComplete
// (every item a Complete) call and returns each item's answer. A batch
// that failed as a whole leaves every item with that failure's answer.
func (w *Workload) callBatch(ctx context.Context, ins []Input) ([]Output, []error) {
	var wait time.Duration
	for _, in := range ins {
		wait = max(wait, in.Wait)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.CallTimeout+wait)
	defer cancel()
	outs, errs := make([]Output, len(ins)), make([]error, len(ins))
	all := func(err error) ([]Output, []error) {
		for i := range ins {
			outs[i], errs[i] = failed(err)
		}
		return outs, errs
	}
	var n int
	if ins[0].Method == Claim {
		req := &idemregv1.BatchClaimRequest{}
		for _, in := range ins {
			req.Requests = append(req.Requests, w.claimRequest(in))
		}
		res, err := w.rpc.BatchClaim(ctx, req)
		if err != nil {
			return all(err)
		}
		n = len(res.GetResults())
		for i, r := range res.GetResults() {
			if i >= len(ins) {
				break
			}
			if st := r.GetError(); st != nil {
				outs[i], errs[i] = failed(status.FromProto(st).Err())
				continue
			}
			outs[i], errs[i] = w.claimOutput(ins[i], r.GetResponse())
		}
	} else {
		req := &idemregv1.BatchCompleteRequest{}
		for _, in := range ins {
			req.Requests = append(req.Requests, w.completeRequest(in))
		}
		res, err := w.rpc.BatchComplete(ctx, req)
		if err != nil {
			return all(err)
		}
		n = len(res.GetResults())
		for i, r := range res.GetResults() {
			if i >= len(ins) {
				break
			}
			if st := r.GetError(); st != nil {
				outs[i], errs[i] = failed(status.FromProto(st).Err())
				continue
			}
			outs[i], errs[i] = w.recordOutput(ins[i], Output{Status: OK}, r.GetResponse().GetRecord())
		}
	}
	if n != len(ins) {
		for i := range ins {
			outs[i], errs[i] = Output{}, fmt.Errorf("batch of %d answered %d results", len(ins), n)
		}
	}
	return outs, errs
}
