package lincheck

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/idemreg/idemreg/client"
)

// ConsumerConfig sizes a ConsumerWorkload. Zero fields take the defaults.
type ConsumerConfig struct {
	// Workers handle messages of the one consumer at once (default 4).
	Workers int
	// Redeliver is the share of messages, in percent, that are a
	// redelivery of a recent message id (default 20).
	Redeliver int
	// Consumer names the consumer (default "lincheck.consumer").
	Consumer string
	// Seed makes the choice of messages repeatable (the interleaving is not).
	Seed uint64
}

func (c *ConsumerConfig) setDefaults() {
	if c.Workers <= 0 {
		c.Workers = 4
	}
	if c.Redeliver == 0 {
		c.Redeliver = 20
	}
	if c.Consumer == "" {
		c.Consumer = "lincheck.consumer"
	}
}

// ConsumerWorkload drives a registry through client.Consumer, whose
// Completes ride with the next Claim, as a message consumer would: fresh
// message ids and redeliveries of recent ones, each handler's result
// naming its key and token. It records every outcome a Done reported
// durable (the message's ack), and Verify checks that each one is what the
// registry replays afterwards, whatever happened to the server meanwhile.
type ConsumerWorkload struct {
	cfg  ConsumerConfig
	cl   *client.Client
	cons *client.Consumer

	mu sync.Mutex
	// acked is the outcome of each message whose Done resolved without
	// error: what the broker was told is done.
	acked map[string]ackedOutcome
	// produced is every result a handler returned, per key: a stored
	// result must be one of them.
	produced   map[string]map[string]bool
	unexpected []string
	recent     []string
	next       int
	// handled counts Handles; ran, those that ran their handler;
	// replayed, those that replayed; failed, those whose Done failed.
	handled, ran, replayed, failed int
	pending                        sync.WaitGroup
}

type ackedOutcome struct {
	token int64
	data  string
}

// NewConsumerWorkload returns a workload on conn.
func NewConsumerWorkload(conn grpc.ClientConnInterface, cfg ConsumerConfig) *ConsumerWorkload {
	cfg.setDefaults()
	cl := client.New(conn)
	return &ConsumerWorkload{
		cfg: cfg, cl: cl,
		// Leases far longer than a run: a killed server's claims stay held,
		// so that nothing but the Consumer's own bookkeeping completes a key.
		cons:     cl.Consumer(cfg.Consumer, client.WithLease(time.Hour), client.WithBookkeepingTimeout(3*time.Second)),
		acked:    map[string]ackedOutcome{},
		produced: map[string]map[string]bool{},
	}
}

// Run runs the workers until ctx ends, then closes the Consumer (sending
// what it holds) and waits for every Done.
func (w *ConsumerWorkload) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for i := range w.cfg.Workers {
		rnd := rand.New(rand.NewPCG(w.cfg.Seed, uint64(i)))
		wg.Go(func() {
			for ctx.Err() == nil {
				w.handle(ctx, w.nextID(rnd))
			}
		})
	}
	wg.Wait()
	cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = w.cons.Close(cctx)
	w.pending.Wait()
}

func (w *ConsumerWorkload) nextID(rnd *rand.Rand) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.recent) > 0 && rnd.IntN(100) < w.cfg.Redeliver {
		return w.recent[rnd.IntN(len(w.recent))]
	}
	id := fmt.Sprintf("m%d", w.next)
	w.next++
	if len(w.recent) < 64 {
		w.recent = append(w.recent, id)
	} else {
		w.recent[w.next%64] = id
	}
	return id
}

func (w *ConsumerWorkload) handle(ctx context.Context, id string) {
	res, done, err := w.cons.Handle(ctx, id, func(_ context.Context, a client.Attempt) ([]byte, error) {
		data := fmt.Sprintf("%s/t%d", a.Key.Key, a.Token)
		w.mu.Lock()
		if w.produced[id] == nil {
			w.produced[id] = map[string]bool{}
		}
		w.produced[id][data] = true
		w.mu.Unlock()
		return []byte(data), nil
	})
	w.mu.Lock()
	w.handled++
	if res.Ran {
		w.ran++
	}
	if res.Replayed {
		w.replayed++
		// A replay must be the acknowledged outcome, when there is one.
		if a, ok := w.acked[id]; ok && err == nil && string(res.Data) != a.data {
			w.unexpected = append(w.unexpected, fmt.Sprintf("%s replayed %q, acknowledged %q", id, res.Data, a.data))
		}
	}
	w.mu.Unlock()
	if err != nil || !res.Ran {
		return
	}
	w.pending.Go(func() {
		derr := done.Err()
		w.mu.Lock()
		defer w.mu.Unlock()
		if derr != nil {
			w.failed++
			return
		}
		rec := done.Record()
		if rec.Result == nil || rec.Result.Response == nil || string(rec.Result.Response.Data) != string(res.Data) {
			w.unexpected = append(w.unexpected, fmt.Sprintf("%s: Done's record is not the handler's result %q", id, res.Data))
			return
		}
		if prev, ok := w.acked[id]; ok && prev.data != string(res.Data) {
			w.unexpected = append(w.unexpected, fmt.Sprintf("%s acknowledged twice: %q then %q", id, prev.data, res.Data))
		}
		w.acked[id] = ackedOutcome{token: rec.Token, data: string(res.Data)}
	})
}

// Stats says how much the run did.
func (w *ConsumerWorkload) Stats() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return fmt.Sprintf("%d handles: %d ran, %d replayed, %d acknowledged, %d Dones failed", w.handled, w.ran, w.replayed, len(w.acked), w.failed)
}

// Acknowledged is how many messages a Done reported durable.
func (w *ConsumerWorkload) Acknowledged() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.acked)
}

// Unexpected lists what the run saw that no correct registry answers: a
// replay other than the acknowledged outcome, a Done whose record is not
// its handler's result.
func (w *ConsumerWorkload) Unexpected() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.unexpected...)
}

// Verify replays every acknowledged message through a fresh Consumer (its
// handler must not run) and looks its record up: completed with the
// acknowledged token and result. Every other key the run claimed must be
// either not completed or completed with a result some handler of it
// returned: nothing else changes.
func (w *ConsumerWorkload) Verify(ctx context.Context) []error {
	w.mu.Lock()
	acked := make(map[string]ackedOutcome, len(w.acked))
	for k, v := range w.acked {
		acked[k] = v
	}
	produced := make(map[string]map[string]bool, len(w.produced))
	for k, v := range w.produced {
		produced[k] = v
	}
	w.mu.Unlock()

	var errs []error
	replay := w.cl.Consumer(w.cfg.Consumer, client.WithLease(time.Hour))
	defer func() { _ = replay.Close(context.WithoutCancel(ctx)) }()
	for id, want := range acked {
		res, done, err := replay.Handle(ctx, id, func(context.Context, client.Attempt) ([]byte, error) {
			return nil, errors.New("an acknowledged message ran again")
		})
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("replay of acknowledged %s: %w", id, err))
		case !res.Replayed || string(res.Data) != want.data:
			errs = append(errs, fmt.Errorf("acknowledged %s (%q) not replayed: ran %v, data %q", id, want.data, res.Ran, res.Data))
		case done.Err() != nil:
			errs = append(errs, fmt.Errorf("replay of acknowledged %s: Done %w", id, done.Err()))
		}
		rec, err := w.cl.Lookup(ctx, client.Key{Consumer: w.cfg.Consumer, Kind: client.KindMessage, Key: id})
		if err != nil {
			errs = append(errs, fmt.Errorf("lookup of acknowledged %s: %w", id, err))
			continue
		}
		if rec.State != client.StateCompleted || rec.Token != want.token {
			errs = append(errs, fmt.Errorf("acknowledged %s: state %v token %d, acknowledged token %d", id, rec.State, rec.Token, want.token))
		}
	}
	for id, results := range produced {
		if _, ok := acked[id]; ok {
			continue
		}
		rec, err := w.cl.Lookup(ctx, client.Key{Consumer: w.cfg.Consumer, Kind: client.KindMessage, Key: id})
		if err != nil {
			if !errors.Is(err, client.ErrNotFound) {
				errs = append(errs, fmt.Errorf("lookup of %s: %w", id, err))
			}
			continue
		}
		if rec.State != client.StateCompleted {
			continue
		}
		if rec.Result == nil || rec.Result.Response == nil || !results[string(rec.Result.Response.Data)] {
			errs = append(errs, fmt.Errorf("%s completed with a result no handler of it returned", id))
		}
	}
	return errs
}
