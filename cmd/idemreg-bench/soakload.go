package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemreg/idemreg/client"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// soakOp is one kind of operation of the soak's load, its share of the
// operations and the calls each makes.
type soakOp struct {
	name   string
	weight int
	calls  int
	what   string
}

var soakOps = []soakOp{
	{"new", 40, 2, "Claim of a new key + Complete"},
	{"replay", 20, 1, "Claim of a completed key, same fingerprint: COMPLETED"},
	{"collide", 10, 1, "Claim of a completed key, another fingerprint: FAILED_PRECONDITION"},
	{"wait", 5, 3, "Claim, a second Claim that waits on it, Complete 100 ms later: the waiter woken COMPLETED"},
	{"batch", 10, 2, "Batch of 8 Claims of new keys, then a Batch of their 8 Completes + 2 replays"},
	{"pipelined", 15, 1, "client.Consumer.Handle of a new key: the Complete rides with a later Claim"},
}

const (
	soakConsumer   = "bench.soak"
	soakBatchKeys  = 8
	soakWaitHold   = 100 * time.Millisecond
	soakOpTimeout  = 30 * time.Second
	soakWaitFor    = 5 * time.Second
	soakRecentKeys = 1024
)

var (
	soakFingerprint      = []byte("soak-fingerprint-a")
	soakOtherFingerprint = []byte("soak-fingerprint-b")
)

func soakMixString() string {
	var parts []string
	for _, o := range soakOps {
		parts = append(parts, fmt.Sprintf("%s %d%% (%s)", o.name, o.weight, o.what))
	}
	return strings.Join(parts, ", ")
}

// soakCallsPerOp is the mean calls of one operation.
func soakCallsPerOp() float64 {
	var w, c int
	for _, o := range soakOps {
		w += o.weight
		c += o.weight * o.calls
	}
	return float64(c) / float64(w)
}

// soakStats is what the load did in one sampling window.
type soakStats struct {
	Calls int
	Ops   map[string]int
	// Errors counts the calls (and batch items) whose code was not the one
	// the operation expects, by code.
	Errors map[string]int
	// Unexpected counts answers that contradict the operation (a replay
	// not COMPLETED, a new key not ACQUIRED); FirstUnexpected says the
	// first of them or of the errors.
	Unexpected      int
	FirstUnexpected string
	// Behind counts the operations due while every worker was busy: not
	// sent, so the rate fell short by them.
	Behind int
	// Expired counts replays and collisions of keys whose retention had
	// run out by the time they were answered: any answer is right for
	// those, so none is judged.
	Expired int
	// WaitersWoken counts waiting Claims answered COMPLETED;
	// WaitersNotWoken those still IN_PROGRESS although the Complete had
	// returned a second or more before their wait ended (a missed wake);
	// WaitsOutlasted those whose wait ended before the Complete returned
	// (a slow Complete, not a missed wake).
	WaitersWoken, WaitersNotWoken, WaitsOutlasted int
	lat                                           []time.Duration
}

func newSoakStats() *soakStats {
	return &soakStats{Ops: map[string]int{}, Errors: map[string]int{}}
}

// soakKey is a key whose Complete was sent at done: its retention ends
// after done + retention, not before.
type soakKey struct {
	key  string
	done time.Time
}

// soakLoad generates the soak's load against one server.
type soakLoad struct {
	cfg      soakConfig
	conn     *grpc.ClientConn
	rpc      idemregv1.RegistryServiceClient
	consumer *client.Consumer
	prefix   string
	seq      atomic.Int64
	result   []byte

	mu  sync.Mutex
	cur *soakStats

	recentMu   sync.Mutex
	recent     []soakKey
	recentNext int

	// held is the pipelined operations whose Complete is not yet durable.
	held sync.WaitGroup
}

func newSoakLoad(addr string, cfg soakConfig) (*soakLoad, error) {
	conn, err := grpc.NewClient(addr, append(soakDialOptions(cfg), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		return nil, err
	}
	c := client.New(conn, client.WithHolder("soak"))
	return &soakLoad{
		cfg: cfg, conn: conn, rpc: idemregv1.NewRegistryServiceClient(conn),
		consumer: c.Consumer(soakConsumer+".pipelined", client.WithLease(30*time.Second), client.WithRetention(cfg.Retention)),
		prefix:   "soak-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-",
		result:   make([]byte, 64),
		cur:      newSoakStats(),
	}, nil
}

func soakDialOptions(cfg soakConfig) []grpc.DialOption {
	var opts []grpc.DialOption
	if w := cfg.Target.StaticWindow; w > 0 {
		opts = append(opts, grpc.WithStaticStreamWindowSize(w), grpc.WithStaticConnWindowSize(w))
	}
	return opts
}

func (l *soakLoad) close() {
	ctx, cancel := context.WithTimeout(context.Background(), soakOpTimeout)
	defer cancel()
	_ = l.consumer.Close(ctx)
	l.held.Wait()
	_ = l.conn.Close()
}

// window returns what the load did since the last call and starts anew.
func (l *soakLoad) window() *soakStats {
	l.mu.Lock()
	defer l.mu.Unlock()
	w := l.cur
	l.cur = newSoakStats()
	return w
}

// drive sends operations at cfg.Rate calls a second, spread over 10 ms
// ticks, to cfg.Workers workers, until ctx ends; then it waits for the
// operations in flight (which run under their own timeouts, not ctx).
func (l *soakLoad) drive(ctx context.Context) {
	jobs := make(chan int)
	var wg sync.WaitGroup
	for range l.cfg.Workers {
		wg.Go(func() {
			for op := range jobs {
				l.do(op)
			}
		})
	}
	var total int
	for _, o := range soakOps {
		total += o.weight
	}
	perSecond := l.cfg.Rate / soakCallsPerOp()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 40))
	start := time.Now()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	sent := 0
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case now := <-tick.C:
			for due := int(perSecond * now.Sub(start).Seconds()); sent < due; sent++ {
				n, op := rng.IntN(total), 0
				for ; n >= soakOps[op].weight; op++ {
					n -= soakOps[op].weight
				}
				select {
				case jobs <- op:
				default:
					l.mu.Lock()
					l.cur.Behind++
					l.mu.Unlock()
				}
			}
		}
	}
	close(jobs)
	wg.Wait()
}

func (l *soakLoad) do(op int) {
	ctx, cancel := context.WithTimeout(context.Background(), soakOpTimeout)
	defer cancel()
	l.mu.Lock()
	l.cur.Ops[soakOps[op].name]++
	l.mu.Unlock()
	switch soakOps[op].name {
	case "new":
		l.newKey(ctx)
	case "replay":
		l.replay(ctx)
	case "collide":
		l.collide(ctx)
	case "wait":
		l.wait(ctx)
	case "batch":
		l.batch(ctx)
	case "pipelined":
		l.pipelined(ctx)
	}
}

// call records one call: its latency (when measured: a waiting Claim's is
// not) and, when its code is not want, an error.
func (l *soakLoad) call(what string, d time.Duration, err error, want codes.Code, measure bool) bool {
	code := status.Code(err)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cur.Calls++
	if measure {
		l.cur.lat = append(l.cur.lat, d)
	}
	if code == want {
		return true
	}
	l.cur.Errors[code.String()]++
	if l.cur.FirstUnexpected == "" {
		l.cur.FirstUnexpected = fmt.Sprintf("%s: %s where %s was expected: %v", what, code, want, err)
	}
	return false
}

// item records one batch item's answer, which is not a call.
func (l *soakLoad) item(what string, code, want codes.Code, msg string) bool {
	if code == want {
		return true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cur.Errors[code.String()]++
	if l.cur.FirstUnexpected == "" {
		l.cur.FirstUnexpected = fmt.Sprintf("%s: %s where %s was expected: %s", what, code, want, msg)
	}
	return false
}

func (l *soakLoad) unexpected(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cur.Unexpected++
	if l.cur.FirstUnexpected == "" {
		l.cur.FirstUnexpected = fmt.Sprintf(format, args...)
	}
}

func (l *soakLoad) key() string { return l.prefix + strconv.FormatInt(l.seq.Add(1), 36) }

func (l *soakLoad) remember(key string, sent time.Time) {
	l.recentMu.Lock()
	defer l.recentMu.Unlock()
	k := soakKey{key, sent}
	if len(l.recent) < soakRecentKeys {
		l.recent = append(l.recent, k)
		return
	}
	l.recent[l.recentNext] = k
	l.recentNext = (l.recentNext + 1) % soakRecentKeys
}

// recentKey is a key completed within half its retention, so that it is
// most likely still there to replay, or none (key "").
func (l *soakLoad) recentKey() soakKey {
	l.recentMu.Lock()
	defer l.recentMu.Unlock()
	if len(l.recent) == 0 {
		return soakKey{}
	}
	fresh := time.Now().Add(-l.cfg.Retention / 2)
	if k := l.recent[rand.IntN(len(l.recent))]; k.done.After(fresh) {
		return k
	}
	// The newest: the one before the next to be replaced.
	k := l.recent[(l.recentNext+len(l.recent)-1)%len(l.recent)]
	if k.done.After(fresh) {
		return k
	}
	return soakKey{}
}

// live says whether k's retention surely had not run out by now: an
// answer given before now must then show it completed.
func (l *soakLoad) live(k soakKey) bool { return time.Now().Before(k.done.Add(l.cfg.Retention)) }

// expired counts an answer about a key whose retention may have run out,
// and completes the key when the answer acquired it, so that no lease is
// left to run out.
func (l *soakLoad) expired(ctx context.Context, key string, res *idemregv1.ClaimResponse) {
	l.mu.Lock()
	l.cur.Expired++
	l.mu.Unlock()
	if res.GetOutcome() == idemregv1.Outcome_OUTCOME_ACQUIRED {
		l.complete(ctx, "an expired key's Complete", key, res)
	}
}

func (l *soakLoad) claimRequest(key string, fingerprint []byte, wait time.Duration) *idemregv1.ClaimRequest {
	r := &idemregv1.ClaimRequest{
		Consumer: soakConsumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key, Fingerprint: fingerprint,
		Lease: durationpb.New(30 * time.Second), Retention: durationpb.New(l.cfg.Retention), Holder: "soak",
	}
	if wait > 0 {
		r.Wait = durationpb.New(wait)
	}
	return r
}

func (l *soakLoad) completeRequest(key string, res *idemregv1.ClaimResponse) *idemregv1.CompleteRequest {
	return &idemregv1.CompleteRequest{
		Consumer: soakConsumer, Kind: idemregv1.Kind_KIND_MESSAGE, Key: key, Token: res.GetToken(), ClaimSecret: res.GetClaimSecret(),
		Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: "bench.v1.Done", Data: l.result}}},
	}
}

// claim makes one Claim and records it.
func (l *soakLoad) claim(ctx context.Context, what, key string, fingerprint []byte, wait time.Duration, want codes.Code) (*idemregv1.ClaimResponse, bool) {
	t0 := time.Now()
	res, err := l.rpc.Claim(ctx, l.claimRequest(key, fingerprint, wait))
	return res, l.call(what, time.Since(t0), err, want, wait == 0)
}

func (l *soakLoad) complete(ctx context.Context, what, key string, res *idemregv1.ClaimResponse) bool {
	t0 := time.Now()
	_, err := l.rpc.Complete(ctx, l.completeRequest(key, res))
	return l.call(what, time.Since(t0), err, codes.OK, true)
}

func (l *soakLoad) newKey(ctx context.Context) {
	key := l.key()
	res, ok := l.claim(ctx, "new key's Claim", key, soakFingerprint, 0, codes.OK)
	if !ok {
		return
	}
	if res.GetOutcome() != idemregv1.Outcome_OUTCOME_ACQUIRED {
		l.unexpected("new key's Claim answered %s", res.GetOutcome())
		return
	}
	sent := time.Now()
	if l.complete(ctx, "new key's Complete", key, res) {
		l.remember(key, sent)
	}
}

func (l *soakLoad) replay(ctx context.Context) {
	k := l.recentKey()
	if k.key == "" {
		l.newKey(ctx)
		return
	}
	t0 := time.Now()
	res, err := l.rpc.Claim(ctx, l.claimRequest(k.key, soakFingerprint, 0))
	d := time.Since(t0)
	if !l.live(k) {
		l.call("replay's Claim", d, err, status.Code(err), true)
		l.expired(ctx, k.key, res)
		return
	}
	if !l.call("replay's Claim", d, err, codes.OK, true) {
		return
	}
	if o := res.GetOutcome(); o != idemregv1.Outcome_OUTCOME_COMPLETED {
		l.unexpected("replay's Claim of a live completed key answered %s", o)
		if o == idemregv1.Outcome_OUTCOME_ACQUIRED {
			l.complete(ctx, "replay's Complete", k.key, res)
		}
	}
}

func (l *soakLoad) collide(ctx context.Context) {
	k := l.recentKey()
	if k.key == "" {
		l.newKey(ctx)
		return
	}
	t0 := time.Now()
	res, err := l.rpc.Claim(ctx, l.claimRequest(k.key, soakOtherFingerprint, 0))
	d := time.Since(t0)
	if !l.live(k) {
		l.call("collision's Claim", d, err, status.Code(err), true)
		l.expired(ctx, k.key, res)
		return
	}
	if !l.call("collision's Claim", d, err, codes.FailedPrecondition, true) && res.GetOutcome() == idemregv1.Outcome_OUTCOME_ACQUIRED {
		l.complete(ctx, "collision's Complete", k.key, res)
	}
}

func (l *soakLoad) wait(ctx context.Context) {
	key := l.key()
	res, ok := l.claim(ctx, "held key's Claim", key, soakFingerprint, 0, codes.OK)
	if !ok {
		return
	}
	if res.GetOutcome() != idemregv1.Outcome_OUTCOME_ACQUIRED {
		l.unexpected("held key's Claim answered %s", res.GetOutcome())
		return
	}
	type answer struct {
		res            *idemregv1.ClaimResponse
		sent, answered time.Time
	}
	woken := make(chan answer, 1)
	go func() {
		sent := time.Now()
		w, ok := l.claim(ctx, "waiting Claim", key, soakFingerprint, soakWaitFor, codes.OK)
		if !ok {
			w = nil
		}
		woken <- answer{w, sent, time.Now()}
	}()
	time.Sleep(soakWaitHold)
	sent := time.Now()
	completed := l.complete(ctx, "held key's Complete", key, res)
	returned := time.Now()
	if completed {
		l.remember(key, sent)
	}
	a := <-woken
	if completed && !a.answered.Before(sent.Add(l.cfg.Retention)) {
		// Answered after the key's retention may have run out.
		l.expired(ctx, key, a.res)
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	switch outcome := a.res.GetOutcome(); {
	case outcome == idemregv1.Outcome_OUTCOME_COMPLETED:
		l.cur.WaitersWoken++
	case outcome != idemregv1.Outcome_OUTCOME_IN_PROGRESS:
		// An error, counted as such, or an answer no wait should give.
		if outcome != idemregv1.Outcome_OUTCOME_UNSPECIFIED {
			l.cur.Unexpected++
			l.cur.FirstUnexpected = cmpOr(l.cur.FirstUnexpected, fmt.Sprintf("waiting Claim answered %s", outcome))
		}
	case completed && returned.Before(a.sent.Add(soakWaitFor-time.Second)):
		l.cur.WaitersNotWoken++
		l.cur.Unexpected++
		l.cur.FirstUnexpected = cmpOr(l.cur.FirstUnexpected, "waiting Claim not woken: IN_PROGRESS after its wait, though the Complete had returned before it ended")
	default:
		l.cur.WaitsOutlasted++
	}
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func (l *soakLoad) batch(ctx context.Context) {
	keys := make([]string, soakBatchKeys)
	items := make([]*idemregv1.BatchItem, soakBatchKeys)
	for i := range keys {
		keys[i] = l.key()
		items[i] = &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Claim{Claim: l.claimRequest(keys[i], soakFingerprint, 0)}}
	}
	t0 := time.Now()
	res, err := l.rpc.Batch(ctx, &idemregv1.BatchRequest{Items: items})
	if !l.call("Batch of Claims", time.Since(t0), err, codes.OK, true) {
		return
	}
	var completes []*idemregv1.BatchItem
	var completed []string
	for i, r := range res.GetResults() {
		if e := r.GetError(); e != nil {
			l.item("Batch's Claim item", codes.Code(e.GetCode()), codes.OK, e.GetMessage())
			continue
		}
		if o := r.GetClaim().GetOutcome(); o != idemregv1.Outcome_OUTCOME_ACQUIRED {
			l.unexpected("Batch's Claim of a new key answered %s", o)
			continue
		}
		completes = append(completes, &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Complete{Complete: l.completeRequest(keys[i], r.GetClaim())}})
		completed = append(completed, keys[i])
	}
	nCompletes := len(completes)
	var replays []soakKey
	for range 2 {
		if k := l.recentKey(); k.key != "" {
			replays = append(replays, k)
			completes = append(completes, &idemregv1.BatchItem{Item: &idemregv1.BatchItem_Claim{Claim: l.claimRequest(k.key, soakFingerprint, 0)}})
		}
	}
	if len(completes) == 0 {
		return
	}
	t0 = time.Now()
	res, err = l.rpc.Batch(ctx, &idemregv1.BatchRequest{Items: completes})
	if !l.call("Batch of Completes and replays", time.Since(t0), err, codes.OK, true) {
		return
	}
	for i, r := range res.GetResults() {
		if i >= nCompletes && !l.live(replays[i-nCompletes]) {
			l.expired(ctx, replays[i-nCompletes].key, r.GetClaim())
			continue
		}
		if e := r.GetError(); e != nil {
			l.item("Batch's item", codes.Code(e.GetCode()), codes.OK, e.GetMessage())
			continue
		}
		switch {
		case i < nCompletes:
			l.remember(completed[i], t0)
		case r.GetClaim().GetOutcome() != idemregv1.Outcome_OUTCOME_COMPLETED:
			l.unexpected("Batch's replay answered %s", r.GetClaim().GetOutcome())
		}
	}
}

func (l *soakLoad) pipelined(ctx context.Context) {
	key := l.key()
	t0 := time.Now()
	res, done, err := l.consumer.Handle(ctx, key, func(context.Context, client.Attempt) ([]byte, error) { return l.result, nil })
	if !l.call("Consumer.Handle", time.Since(t0), err, codes.OK, true) {
		return
	}
	if !res.Ran {
		l.unexpected("Consumer.Handle of a new key did not run its handler")
		return
	}
	// The Complete is held until a later Claim carries it (or the
	// linger ends): its failure is counted when it is known.
	l.held.Add(1)
	go func() {
		defer l.held.Done()
		wctx, cancel := context.WithTimeout(context.Background(), soakOpTimeout)
		defer cancel()
		if _, err := done.Wait(wctx); err != nil {
			l.item("Consumer's held Complete", status.Code(err), codes.OK, err.Error())
		}
	}()
}
