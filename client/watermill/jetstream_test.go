package watermill_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	wmjs "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/client"
	idemwm "github.com/idemreg/idemreg/client/watermill"
)

// subscriberEnv makes the test binary a subscriber process (see
// runSubscriber) instead of running the tests; the other variables
// configure it.
const (
	subscriberEnv = "WATERMILL_TEST_SUBSCRIBER"
	envRegistry   = "WATERMILL_TEST_REGISTRY"
	envNATS       = "WATERMILL_TEST_NATS"
	envStream     = "WATERMILL_TEST_STREAM"
	envDurable    = "WATERMILL_TEST_DURABLE"
	envBucket     = "WATERMILL_TEST_BUCKET"
	envConsumer   = "WATERMILL_TEST_CONSUMER"
	envLog        = "WATERMILL_TEST_LOG"
	// envStall names a key after whose effect the process stops, holding
	// the key, until it is killed.
	envStall = "WATERMILL_TEST_STALL"
)

// natsURL is the NATS server with JetStream the test publishes to
// (.ci/ensure-nats starts one on 127.0.0.1:4222).
func natsURL(t *testing.T) string {
	t.Helper()
	u := os.Getenv("IDEMREG_TEST_NATS_URL")
	if u == "" {
		u = "nats://127.0.0.1:4222"
	}
	pu, err := url.Parse(u)
	require.NoError(t, err)
	c, err := net.DialTimeout("tcp", pu.Host, time.Second)
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI: no NATS server at %s (.ci/ensure-nats starts one): %v", u, err)
		}
		t.Skipf("no NATS server at %s (.ci/ensure-nats starts one): %v", u, err)
	}
	c.Close()
	return u
}

// Messages with duplicates (each key published twice, back to back, under
// two UUIDs) through Watermill's JetStream adapter, to two subscriber
// processes sharing one durable consumer, each SIGKILLed once mid-stream
// and replaced: every key's effect is applied exactly once. The first kill
// comes after one process applied a key's effect and before its Complete
// (it stalls there on purpose), the second wherever the other process is.
//
// The effect is an entry in a JetStream key-value bucket, written as
// docs/client.md asks of a handler: a first attempt creates it; an attempt
// above 1 (an earlier holder's lease ran out: it was killed) creates it
// only if that holder did not get to. A key's entry created twice, which
// the registry's de-duplication alone prevents here, is logged as a
// violation. The handlers' runs are logged too, to check that a key ran
// again only after a holder was killed.
func TestJetStreamSubscriberKilledMidStream(t *testing.T) {
	natsAddr := natsURL(t)
	const keys = 150
	suffix := randomHex(t)
	stream, durable, bucket := "idemregwm"+suffix, "idemregwm"+suffix, "idemregwm"+suffix
	// Keys are fixed (k-0, k-1, ...): the consumer is this run's own.
	consumer := consumerName(t) + "." + suffix

	nc, err := nats.Connect(natsAddr)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := t.Context()
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{stream}, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })
	// A killed subscriber's unacked messages come back after AckWait.
	cons, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable: durable, AckPolicy: jetstream.AckExplicitPolicy, AckWait: 2 * time.Second,
	})
	require.NoError(t, err)
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteKeyValue(context.Background(), bucket) })

	logPath := filepath.Join(t.TempDir(), "runs.log")
	procs := &subscribers{t: t, env: append(os.Environ(),
		subscriberEnv+"=1", envRegistry+"="+registryAddr, envNATS+"="+natsAddr, envStream+"="+stream,
		envDurable+"="+durable, envBucket+"="+bucket, envConsumer+"="+consumer, envLog+"="+logPath)}
	t.Cleanup(procs.stopAll)

	pub, err := wmjs.NewPublisher(wmjs.PublisherConfig{Conn: nc, Logger: wm.NopLogger{}})
	require.NoError(t, err)
	publish := func(from, to int) {
		for i := from; i < to; i++ {
			for range 2 {
				msg := message.NewMessage(wm.NewUUID(), []byte(strconv.Itoa(i)))
				msg.Metadata.Set("key", fmt.Sprint("k-", i))
				require.NoError(t, pub.Publish(stream, msg))
			}
		}
	}

	const stalled = "k-10"
	publish(0, keys/2)
	// Either may get the key first: the one that does stalls there.
	a, b := procs.start(envStall+"="+stalled), procs.start(envStall+"="+stalled)
	publish(keys/2, keys)
	holder := waitLog(t, logPath, "stalled", 1)[0].pid
	if holder != a.Process.Pid {
		a, b = b, a
	}
	procs.kill(a)
	procs.start()
	waitLog(t, logPath, "run", keys/2)
	procs.kill(b)
	procs.start()

	// Done: every message acked, every key's effect there.
	require.Eventually(t, func() bool {
		info, err := cons.Info(ctx)
		if err != nil || info.NumPending > 0 || info.NumAckPending > 0 {
			return false
		}
		for i := range keys {
			if _, err := kv.Get(ctx, fmt.Sprint("k-", i)); err != nil {
				return false
			}
		}
		return true
	}, 3*time.Minute, 50*time.Millisecond, "not every message was acked with its effect applied")
	procs.stopAll()

	lines := readLog(t, logPath)
	runsOf := map[string][]logLine{}
	for _, l := range lines {
		require.NotEqual(t, "violation", l.what, "key %s: its effect was applied twice (token %d, attempt %d, pid %d)", l.key, l.token, l.attempt, l.pid)
		if l.what == "run" {
			runsOf[l.key] = append(runsOf[l.key], l)
		}
	}
	c := newClient(t)
	again := 0
	for i := range keys {
		key := fmt.Sprint("k-", i)
		rs := runsOf[key]
		require.NotEmpty(t, rs, "key %s never ran", key)
		// Every run but the last was a killed subscriber's: a key runs
		// again only when its holder died before its Complete.
		for _, r := range rs[:len(rs)-1] {
			require.True(t, procs.killedPid(r.pid), "key %s ran again after a run of pid %d, which was not killed: %v", key, r.pid, rs)
		}
		firsts := 0
		for _, r := range rs {
			if r.attempt == 1 {
				firsts++
			}
		}
		require.LessOrEqual(t, firsts, 1, "key %s: %v", key, rs)
		if len(rs) > 1 {
			again++
		}
		require.Equal(t, client.StateCompleted, lookup(t, c, consumer, key).State, "key %s", key)
	}
	// The stalled key ran again (the registry gave it to another process
	// once the killed holder's lease ran out), and its effect is the killed
	// holder's.
	rs := runsOf[stalled]
	require.GreaterOrEqual(t, len(rs), 2, "%s: %v", stalled, rs)
	require.Equal(t, int64(1), rs[0].attempt)
	require.Equal(t, a.Process.Pid, rs[0].pid)
	require.Greater(t, rs[len(rs)-1].attempt, int64(1))
	entry, err := kv.Get(ctx, stalled)
	require.NoError(t, err)
	require.Equal(t, strconv.FormatInt(rs[0].token, 10), string(entry.Value()))

	t.Logf("%d messages (%d keys, each twice), 2 subscribers each SIGKILLed once: %d handler runs, %d keys run again after a kill",
		2*keys, keys, len(runsOf)+countAgain(runsOf), again)
}

func countAgain(runsOf map[string][]logLine) int {
	n := 0
	for _, rs := range runsOf {
		n += len(rs) - 1
	}
	return n
}

func randomHex(t *testing.T) string {
	b := make([]byte, 6)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return hex.EncodeToString(b)
}

// subscribers are the subscriber processes of a test.
type subscribers struct {
	t   *testing.T
	env []string

	mu     sync.Mutex
	procs  []*exec.Cmd
	killed map[int]bool
}

func (s *subscribers) start(env ...string) *exec.Cmd {
	s.t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(s.env[:len(s.env):len(s.env)], env...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	require.NoError(s.t, cmd.Start())
	s.mu.Lock()
	s.procs = append(s.procs, cmd)
	s.mu.Unlock()
	return cmd
}

// kill SIGKILLs cmd: no deferred function, no Close, no held Complete sent.
func (s *subscribers) kill(cmd *exec.Cmd) {
	s.mu.Lock()
	if s.killed == nil {
		s.killed = map[int]bool{}
	}
	s.killed[cmd.Process.Pid] = true
	s.mu.Unlock()
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
}

func (s *subscribers) killedPid(pid int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.killed[pid]
}

func (s *subscribers) stopAll() {
	s.mu.Lock()
	procs := s.procs
	s.procs = nil
	s.mu.Unlock()
	for _, cmd := range procs {
		if cmd.ProcessState != nil {
			continue
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			s.t.Errorf("subscriber %d did not stop within 15 s of SIGTERM; killed", cmd.Process.Pid)
			_ = cmd.Process.Kill()
			<-exited
		}
	}
}

type logLine struct {
	what    string
	key     string
	token   int64
	attempt int64
	pid     int
}

func (l logLine) String() string {
	return fmt.Sprintf("%s(token %d, attempt %d, pid %d)", l.what, l.token, l.attempt, l.pid)
}

func readLog(t *testing.T, path string) []logLine {
	t.Helper()
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	require.NoError(t, err)
	defer f.Close()
	var out []logLine
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var l logLine
		if _, err := fmt.Sscan(sc.Text(), &l.what, &l.key, &l.token, &l.attempt, &l.pid); err != nil {
			continue // a line cut by a kill mid-write
		}
		out = append(out, l)
	}
	require.NoError(t, sc.Err())
	return out
}

// waitLog waits until the log shows at least n lines of what, and
// returns them.
func waitLog(t *testing.T, path, what string, n int) []logLine {
	t.Helper()
	var seen []logLine
	require.Eventually(t, func() bool {
		seen = seen[:0]
		for _, l := range readLog(t, path) {
			if l.what == what {
				seen = append(seen, l)
			}
		}
		return len(seen) >= n
	}, 2*time.Minute, 5*time.Millisecond, "fewer than %d %q lines", n, what)
	return seen
}

// runSubscriber is a subscriber process: a Watermill router reading the
// durable JetStream consumer through the middleware until it is killed.
func runSubscriber() int {
	if err := subscribe(); err != nil {
		fmt.Fprintln(os.Stderr, "subscriber:", err)
		return 1
	}
	return 0
}

func subscribe() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	c, conn, err := dial(os.Getenv(envRegistry))
	if err != nil {
		return err
	}
	defer conn.Close()
	nc, err := nats.Connect(os.Getenv(envNATS))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	kv, err := js.KeyValue(ctx, os.Getenv(envBucket))
	if err != nil {
		return err
	}
	logf, err := os.OpenFile(os.Getenv(envLog), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	pid := os.Getpid()
	stall := os.Getenv(envStall)
	// One write per line, so that a line is never interleaved with
	// another process's.
	note := func(what string, a client.Attempt) error {
		_, err := fmt.Fprintf(logf, "%s %s %d %d %d\n", what, a.Key.Key, a.Token, a.Attempt, pid)
		return err
	}

	stream, durable := os.Getenv(envStream), os.Getenv(envDurable)
	sub, err := wmjs.NewSubscriber(wmjs.SubscriberConfig{
		Conn:   nc,
		Logger: wm.NopLogger{},
		ResourceInitializer: func(ctx context.Context, js jetstream.JetStream, topic string) (jetstream.Consumer, func(context.Context, wm.LoggerAdapter), error) {
			cons, err := js.Consumer(ctx, stream, durable)
			return cons, nil, err
		},
		AckWaitTimeout: 20 * time.Second,
	})
	if err != nil {
		return err
	}
	d := idemwm.New(c, os.Getenv(envConsumer),
		idemwm.WithKey(idemwm.KeyFromMetadata("key")),
		// Short, so that a killed holder's key is taken over soon; long
		// enough that a live holder's run of a few milliseconds never
		// outlasts it on a loaded machine.
		idemwm.WithConsumerOptions(client.WithLease(2*time.Second)),
		idemwm.WithInProgressDelay(100*time.Millisecond))
	defer d.Close(context.WithoutCancel(ctx))

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, wm.NopLogger{})
	if err != nil {
		return err
	}
	router.AddMiddleware(d.Middleware)
	router.AddNoPublisherHandler("effects", stream, sub, func(msg *message.Message) error {
		a, ok := idemwm.AttemptFromContext(msg.Context())
		if !ok {
			return errors.New("no attempt in the message's context")
		}
		if err := note("run", a); err != nil {
			return err
		}
		key := a.Key.Key
		if a.Attempt > 1 {
			// An earlier holder was killed: it may have applied the effect.
			if _, err := kv.Get(msg.Context(), key); err == nil {
				return nil
			} else if !errors.Is(err, jetstream.ErrKeyNotFound) {
				return err
			}
		}
		_, err := kv.Create(msg.Context(), key, []byte(strconv.FormatInt(a.Token, 10)))
		if errors.Is(err, jetstream.ErrKeyExists) {
			return note("violation", a)
		}
		if err == nil && key == stall {
			// Effect applied, Complete not sent: the holder dies here.
			if err := note("stalled", a); err != nil {
				return err
			}
			<-ctx.Done()
			return ctx.Err()
		}
		return err
	})
	return router.Run(ctx)
}
