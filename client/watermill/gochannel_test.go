package watermill_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client"
	idemwm "github.com/idemreg/idemreg/client/watermill"
)

// consumerName is a registry consumer of the test's own, so that tests
// sharing the registry never share keys.
func consumerName(t *testing.T) string {
	return "watermill." + strings.NewReplacer("/", ".", "#", "-").Replace(t.Name())
}

// runs records the handler's runs per key, with the claim each ran under.
type runs struct {
	mu sync.Mutex
	by map[string][]client.Attempt
}

func (r *runs) add(key string, a client.Attempt) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.by == nil {
		r.by = map[string][]client.Attempt{}
	}
	r.by[key] = append(r.by[key], a)
	return len(r.by[key])
}

func (r *runs) of(key string) []client.Attempt {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]client.Attempt(nil), r.by[key]...)
}

// outbox collects what the routers publish to the output topic, acking it.
type outbox struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (o *outbox) collect(ch <-chan *message.Message) {
	for m := range ch {
		o.mu.Lock()
		o.msgs = append(o.msgs, m)
		o.mu.Unlock()
		m.Ack()
	}
}

func (o *outbox) all() []*message.Message {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]*message.Message(nil), o.msgs...)
}

// nacks counts the errors the routers' handlers return (each one a nack).
type nacks struct {
	mu   sync.Mutex
	errs []error
}

func (n *nacks) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err != nil {
			n.mu.Lock()
			n.errs = append(n.errs, err)
			n.mu.Unlock()
		}
		return out, err
	}
}

func (n *nacks) all() []error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]error(nil), n.errs...)
}

const (
	inTopic  = "in"
	outTopic = "out"
)

// rig is Watermill's in-process pub/sub with routers subscribed to
// inTopic through the middleware: Publish returns once every router has
// acked the message (gochannel resends a nacked message at once, until
// it is acked), and what the routers publish is in out.
type rig struct {
	in    *gochannel.GoChannel
	out   *outbox
	nacks *nacks
}

// newRig starts one router per Deduplicator, each with its own handler
// subscribed to inTopic (gochannel gives each subscriber every message:
// each router stands for one instance of a service receiving the same
// delivery).
func newRig(t *testing.T, ds []*idemwm.Deduplicator, h message.HandlerFunc) *rig {
	t.Helper()
	logger := wm.NopLogger{}
	r := &rig{
		in:    gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger),
		out:   &outbox{},
		nacks: &nacks{},
	}
	outPS := gochannel.NewGoChannel(gochannel.Config{}, logger)
	outCh, err := outPS.Subscribe(context.Background(), outTopic)
	require.NoError(t, err)
	go r.out.collect(outCh)

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i, d := range ds {
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
		require.NoError(t, err)
		// The first middleware added is the outermost: it sees the
		// Deduplicator's errors, which are the router's nacks.
		router.AddMiddleware(r.nacks.middleware, d.Middleware)
		router.AddHandler(fmt.Sprintf("handler-%d", i), inTopic, r.in, outTopic, outPS, h)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := router.Run(ctx); err != nil {
				t.Errorf("router: %v", err)
			}
		}()
		<-router.Running()
	}
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		for _, d := range ds {
			require.NoError(t, d.Close(context.Background()))
		}
		_ = r.in.Close()
		_ = outPS.Close()
	})
	return r
}

// publish publishes msg to inTopic and returns once every router acked it,
// or fails the test after a minute.
func (r *rig) publish(t *testing.T, msg *message.Message) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- r.in.Publish(inTopic, msg) }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(time.Minute):
		t.Fatalf("message %s was not acked within a minute", msg.UUID)
	}
}

// producing is a handler that records its run under the key and produces
// one message per run, numbered by the run.
func producing(rs *runs) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		a, ok := idemwm.AttemptFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no attempt in the message's context")
		}
		n := rs.add(a.Key.Key, a)
		out := message.NewMessage(wm.NewUUID(), []byte("produced:"+string(msg.Payload)))
		out.Metadata.Set("run", fmt.Sprint(n))
		return []*message.Message{out}, nil
	}
}

func lookup(t *testing.T, c *client.Client, consumer, key string) client.Record {
	t.Helper()
	rec, err := c.Lookup(t.Context(), client.Key{Consumer: consumer, Kind: client.KindMessage, Key: key})
	require.NoError(t, err)
	return rec
}

// A redelivered message (the same UUID) is acked without running the
// handler, and the first run's produced message is published again, the
// same UUID, metadata and payload; the outcome is stored before the ack.
func TestRedeliveryReplaysProducedMessages(t *testing.T) {
	c := newClient(t)
	consumer := consumerName(t)
	rs := &runs{}
	r := newRig(t, []*idemwm.Deduplicator{idemwm.New(c, consumer)}, producing(rs))

	msg := message.NewMessage(wm.NewUUID(), []byte("order-1"))
	r.publish(t, msg)
	rec := lookup(t, c, consumer, msg.UUID)
	require.Equal(t, client.StateCompleted, rec.State, "acked before the outcome was stored")
	require.Equal(t, idemwm.ResultType, rec.Result.Response.Type)

	r.publish(t, msg.Copy())
	r.publish(t, msg.Copy())
	require.Len(t, rs.of(msg.UUID), 1, "the handler ran for a duplicate")
	require.Empty(t, r.nacks.all())

	require.Eventually(t, func() bool { return len(r.out.all()) == 3 }, 10*time.Second, 10*time.Millisecond)
	out := r.out.all()
	for _, m := range out[1:] {
		require.Equal(t, out[0].UUID, m.UUID)
		require.Equal(t, "produced:order-1", string(m.Payload))
		require.Equal(t, "1", m.Metadata.Get("run"))
	}
}

// Duplicates delivered to several instances at once run the handler once:
// the others find the key in progress and are nacked, then redelivered and
// acked with the replay; with client.WithInProgressWait they wait for the
// outcome instead, and nothing is nacked.
func TestConcurrentDuplicatesRunOnce(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []idemwm.Option
		wait bool
	}{
		{name: "nack", opts: []idemwm.Option{idemwm.WithInProgressDelay(20 * time.Millisecond)}},
		{name: "wait", opts: []idemwm.Option{idemwm.WithConsumerOptions(client.WithInProgressWait(30 * time.Second))}, wait: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const instances, messages = 4, 20
			consumer := consumerName(t)
			rs := &runs{}
			var ds []*idemwm.Deduplicator
			for range instances {
				ds = append(ds, idemwm.New(newClient(t), consumer, tc.opts...))
			}
			slow := producing(rs)
			r := newRig(t, ds, func(msg *message.Message) ([]*message.Message, error) {
				// Long enough that the other instances' Claims come while
				// it runs.
				time.Sleep(30 * time.Millisecond)
				return slow(msg)
			})
			var keys []string
			for i := range messages {
				msg := message.NewMessage(wm.NewUUID(), []byte(fmt.Sprint("m", i)))
				keys = append(keys, msg.UUID)
				r.publish(t, msg)
			}
			c := newClient(t)
			for _, k := range keys {
				require.Len(t, rs.of(k), 1, "key %s", k)
				require.Equal(t, client.StateCompleted, lookup(t, c, consumer, k).State)
			}
			require.Eventually(t, func() bool { return len(r.out.all()) == instances*messages }, 10*time.Second, 10*time.Millisecond)
			byUUID := map[string]int{}
			for _, m := range r.out.all() {
				byUUID[m.UUID]++
			}
			require.Len(t, byUUID, messages, "each key's one produced message, replayed to every instance")
			for u, n := range byUUID {
				require.Equal(t, instances, n, "produced message %s", u)
			}
			for _, err := range r.nacks.all() {
				require.ErrorIs(t, err, client.ErrInProgress)
			}
			if tc.wait {
				require.Empty(t, r.nacks.all())
			}
			t.Logf("%d messages to %d instances: %d nacks of a key in progress", messages, instances, len(r.nacks.all()))
		})
	}
}

// A retryable failure releases the key and nacks the message; the
// redelivery runs the handler again, with a larger token and Attempt 2,
// and is acked.
func TestRetryableFailureNackedThenRuns(t *testing.T) {
	c := newClient(t)
	consumer := consumerName(t)
	rs := &runs{}
	ok := producing(rs)
	var failed sync.Once
	errDown := errors.New("the database is down")
	r := newRig(t, []*idemwm.Deduplicator{idemwm.New(c, consumer)}, func(msg *message.Message) ([]*message.Message, error) {
		var err error
		failed.Do(func() {
			a, _ := idemwm.AttemptFromContext(msg.Context())
			rs.add(a.Key.Key, a)
			err = errDown
		})
		if err != nil {
			return nil, err
		}
		return ok(msg)
	})
	msg := message.NewMessage(wm.NewUUID(), []byte("order-2"))
	r.publish(t, msg)

	got := rs.of(msg.UUID)
	require.Len(t, got, 2)
	require.Equal(t, int64(1), got[0].Attempt)
	require.Equal(t, int64(2), got[1].Attempt)
	require.Greater(t, got[1].Token, got[0].Token)
	nacked := r.nacks.all()
	require.Len(t, nacked, 1)
	require.ErrorIs(t, nacked[0], errDown)
	require.Equal(t, client.StateCompleted, lookup(t, c, consumer, msg.UUID).State)

	r.publish(t, msg.Copy())
	require.Len(t, rs.of(msg.UUID), 2, "the handler ran for a duplicate of a completed key")
}

// A final failure (client.Final, or an error WithFinal classifies) is
// stored and the message acked; a duplicate is acked without running the
// handler, and nothing is published for either.
func TestFinalFailureStoredAndReplayed(t *testing.T) {
	errDeclined := errors.New("card declined")
	for _, tc := range []struct {
		name string
		opts []idemwm.Option
		err  error
	}{
		{name: "client.Final", err: client.Final(errDeclined)},
		{name: "WithFinal", opts: []idemwm.Option{idemwm.WithFinal(func(err error) bool { return errors.Is(err, errDeclined) })}, err: fmt.Errorf("charge: %w", errDeclined)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newClient(t)
			consumer := consumerName(t)
			rs := &runs{}
			r := newRig(t, []*idemwm.Deduplicator{idemwm.New(c, consumer, tc.opts...)}, func(msg *message.Message) ([]*message.Message, error) {
				a, _ := idemwm.AttemptFromContext(msg.Context())
				rs.add(a.Key.Key, a)
				return nil, tc.err
			})
			msg := message.NewMessage(wm.NewUUID(), []byte("order-3"))
			r.publish(t, msg)
			rec := lookup(t, c, consumer, msg.UUID)
			require.Equal(t, client.StateCompleted, rec.State)
			require.NotNil(t, rec.Result.Failure)
			require.Contains(t, rec.Result.Failure.Message(), "card declined")

			r.publish(t, msg.Copy())
			require.Len(t, rs.of(msg.UUID), 1)
			require.Empty(t, r.nacks.all())
			require.Empty(t, r.out.all())
		})
	}
}
