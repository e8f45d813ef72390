// Command ledger is an inbox-style JetStream consumer: it applies payment
// messages to a PostgreSQL ledger exactly once in effect, with a write
// fenced by the claim's token, through a client.Consumer (-mode pipelined,
// the default: one registry round trip per message, each message acked
// once its outcome is durable) or client.OnceBatch on fetched batches
// (-mode batch: one BatchClaim and one BatchComplete per batch). Run
// several of them
// on one durable consumer, kill any of them at any point: every payment
// ends up in the ledger once.
//
//	ledger -registry 127.0.0.1:7350 -nats nats://127.0.0.1:4222 \
//	       -database postgres://postgres@127.0.0.1:5432/ledger?sslmode=disable
//
// See examples/README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/client"
)

type config struct {
	registry, natsURL, database string
	stream, subject, durable    string
	name                        string
	mode                        string
	workers, batch              int
	lease, ackWait              time.Duration
	// Demo and test hooks.
	slow       time.Duration
	stallAfter string
}

func parseFlags(args []string) (config, error) {
	var c config
	host, _ := os.Hostname()
	fs := flag.NewFlagSet("ledger", flag.ContinueOnError)
	fs.StringVar(&c.registry, "registry", "127.0.0.1:7350", "idemreg registry address")
	fs.StringVar(&c.natsURL, "nats", nats.DefaultURL, "NATS server URL")
	fs.StringVar(&c.database, "database", "postgres://postgres@127.0.0.1:5432/ledger?sslmode=disable", "PostgreSQL URL of the ledger")
	fs.StringVar(&c.stream, "stream", "PAYMENTS", "JetStream stream (created when missing)")
	fs.StringVar(&c.subject, "subject", "payments.>", "subject of the payment messages")
	fs.StringVar(&c.durable, "durable", "ledger", "durable consumer name, shared by every replica")
	fs.StringVar(&c.name, "name", fmt.Sprintf("%s/%d", host, os.Getpid()), "this replica's name, in the registry and the ledger")
	fs.StringVar(&c.mode, "mode", "pipelined", "pipelined (client.Consumer) or batch (client.OnceBatch)")
	fs.IntVar(&c.workers, "workers", 4, "batches handled at once")
	fs.IntVar(&c.batch, "batch", 16, "messages fetched in one batch")
	fs.DurationVar(&c.lease, "lease", 5*time.Second, "idemreg lease: how long a crashed replica blocks a payment")
	fs.DurationVar(&c.ackWait, "ack-wait", 5*time.Second, "JetStream ack wait: how soon a crashed replica's messages are redelivered")
	fs.DurationVar(&c.slow, "slow", 0, "demo: pause after each ledger write")
	fs.StringVar(&c.stallAfter, "stall-after-write", "", "demo: hang after writing this payment on its first attempt, to be killed there")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.workers < 1 || c.batch < 1 {
		return c, errors.New("-workers and -batch must be positive")
	}
	if c.mode != "pipelined" && c.mode != "batch" {
		return c, errors.New("-mode must be pipelined or batch")
	}
	return c, nil
}

func main() {
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		os.Exit(2)
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("replica", cfg.name)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, logger); err != nil {
		logger.Error("ledger consumer failed", "error", err)
		os.Exit(1)
	}
}

// consumer is the name of the ledger's key space in the registry: one
// handler, one scope. Another handler of the same messages uses its own.
const consumer = "ledger.payments"

func run(ctx context.Context, cfg config, logger *slog.Logger) error {
	ledger, err := openLedger(ctx, cfg.database, cfg.name)
	if err != nil {
		return err
	}
	defer ledger.Close()

	conn, err := grpc.NewClient(cfg.registry, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	reg := client.New(conn, client.WithHolder(cfg.name), client.WithLogger(logger))

	nc, err := nats.Connect(cfg.natsURL, nats.Name("ledger "+cfg.name))
	if err != nil {
		return fmt.Errorf("nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	if err := ensureStream(ctx, js, cfg.stream, cfg.subject); err != nil {
		return err
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, cfg.stream, jetstream.ConsumerConfig{
		Durable:       cfg.durable,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       cfg.ackWait,
		FilterSubject: cfg.subject,
	})
	if err != nil {
		return fmt.Errorf("jetstream consumer: %w", err)
	}
	logger.Info("consuming", "stream", cfg.stream, "durable", cfg.durable)

	h := &handler{cfg: cfg, reg: reg, ledger: ledger, logger: logger}
	handle := h.handle
	if cfg.mode == "pipelined" {
		// One Consumer for every worker: a Complete held by one worker
		// rides with whichever worker claims next.
		h.consumer = reg.Consumer(consumer, client.WithLease(cfg.lease))
		defer func() {
			// Send what is held, so that a clean stop leaves nothing to redeliver.
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if err := h.consumer.Close(fctx); err != nil {
				logger.Warn("flushing the held completes", "error", err)
			}
			h.acks.Wait()
		}()
		handle = h.handlePipelined
	}
	var wg sync.WaitGroup
	for range cfg.workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				// A short wait, so that a stop is noticed between fetches.
				batch, err := cons.Fetch(cfg.batch, jetstream.FetchMaxWait(time.Second))
				if err != nil {
					logger.Warn("fetching messages", "error", err)
					sleep(ctx, time.Second)
					continue
				}
				var msgs []jetstream.Msg
				for msg := range batch.Messages() {
					msgs = append(msgs, msg)
				}
				if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
					logger.Warn("fetching messages", "error", err) // what came before it is handled
				}
				handle(ctx, msgs)
			}
		})
	}
	wg.Wait()
	logger.Info("stopped")
	return nil
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// ensureStream creates the stream when it is missing.
func ensureStream(ctx context.Context, js jetstream.JetStream, name, subject string) error {
	_, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject}, Storage: jetstream.FileStorage})
	if err != nil {
		return fmt.Errorf("jetstream stream %s: %w", name, err)
	}
	return nil
}

type handler struct {
	cfg    config
	reg    *client.Client
	ledger *Ledger
	logger *slog.Logger
	// consumer and acks: -mode pipelined only.
	consumer *client.Consumer
	acks     sync.WaitGroup
}

// apply is the work of one payment, in either mode.
func (h *handler) apply(ctx context.Context, p Payment, a client.Attempt) ([]byte, error) {
	if err := p.validate(); err != nil {
		return nil, client.Final(err)
	}
	if err := h.ledger.Apply(ctx, p, a.Token, a.Attempt); err != nil {
		return nil, err
	}
	if p.ID == h.cfg.stallAfter && a.Attempt == 1 {
		h.logger.Info("stalling after the ledger write", "payment", p.ID)
		<-ctx.Done() // until killed (or the lease is lost)
		return nil, ctx.Err()
	}
	if h.cfg.slow > 0 {
		time.Sleep(h.cfg.slow)
	}
	return nil, nil
}

// handlePipelined applies each message through the Consumer and acks it
// once its Done says the outcome is durable, without waiting for that
// before the next message: the Complete rides with the next Claim. A crash
// loses the held Completes, whose messages were never acked: JetStream
// redelivers them and the registry hands them over when the lease ends.
func (h *handler) handlePipelined(ctx context.Context, msgs []jetstream.Msg) {
	for _, msg := range msgs {
		p, err := decodePayment(msg.Data())
		if err != nil {
			h.logger.Warn("undecodable message terminated", "error", err)
			_ = msg.Term()
			continue
		}
		res, done, err := h.consumer.Handle(ctx, p.ID, func(ctx context.Context, a client.Attempt) ([]byte, error) {
			return h.apply(ctx, p, a)
		}, client.WithMessageFingerprint(fingerprint(msg.Data())))
		h.acks.Go(func() {
			<-done.Ready()
			if derr := done.Err(); derr != nil && (err == nil || client.IsFinal(err)) {
				err = derr // the outcome was not stored: redeliver
			}
			h.ack(msg, p, client.BatchResult{OnceResult: res, Err: err})
		})
	}
}

// handle applies a fetched batch through OnceBatch (one BatchClaim, one
// BatchComplete) and acknowledges each message once its outcome is
// recorded: applied now, applied before (a replay, or the same payment
// earlier in the batch), or refused for good (a final failure, replayed to
// every duplicate). Anything else is redelivered.
func (h *handler) handle(ctx context.Context, msgs []jetstream.Msg) {
	var (
		todo     []jetstream.Msg
		payments []Payment
		batch    []client.BatchMessage
	)
	for _, msg := range msgs {
		p, err := decodePayment(msg.Data())
		if err != nil {
			// Without an id there is no key to de-duplicate on: park it.
			h.logger.Warn("undecodable message terminated", "error", err)
			_ = msg.Term()
			continue
		}
		todo, payments = append(todo, msg), append(payments, p)
		batch = append(batch, client.BatchMessage{ID: p.ID, Fingerprint: fingerprint(msg.Data())})
	}
	if len(batch) == 0 {
		return
	}
	results := h.reg.OnceBatch(ctx, consumer, batch, func(ctx context.Context, i int, a client.Attempt) ([]byte, error) {
		return h.apply(ctx, payments[i], a)
	}, client.WithLease(h.cfg.lease))

	for i, res := range results {
		h.ack(todo[i], payments[i], res)
	}
}

func (h *handler) ack(msg jetstream.Msg, p Payment, res client.BatchResult) {
	var inProgress *client.InProgressError
	switch err := res.Err; {
	case err == nil:
		h.logger.Info("payment done", "payment", p.ID, "applied", res.Ran, "replayed", res.Replayed)
		_ = msg.Ack()
	case client.IsFinal(err):
		h.logger.Info("payment refused", "payment", p.ID, "replayed", res.Replayed, "error", err)
		_ = msg.Ack()
	case errors.As(err, &inProgress):
		// Another replica has it. It usually finishes well before its
		// lease ends, and a replay is cheap: come back soon.
		_ = msg.NakWithDelay(min(inProgress.RetryAfter, 250*time.Millisecond))
	case errors.Is(err, client.ErrFingerprintMismatch):
		h.logger.Error("payment id reused with another body: terminated", "payment", p.ID)
		_ = msg.Term()
	default:
		h.logger.Warn("payment will be redelivered", "payment", p.ID, "error", err)
		_ = msg.NakWithDelay(time.Second)
	}
}
