package watermill

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemreg/idemreg/client"
)

// KeyFunc returns the key a message is de-duplicated by within its
// consumer. An error, or an empty key, fails the message (a nack) without
// running the handler.
type KeyFunc func(msg *message.Message) (string, error)

// ErrNoKey is returned (and the message nacked) when the KeyFunc finds no
// key in a message. Compose with Watermill's PoisonQueue middleware to set
// such messages aside instead of having them redelivered.
var ErrNoKey = errors.New("idemreg/watermill: the message has no key")

// MessageUUID keys a message by its UUID, the default: a redelivery of the
// same message is a duplicate, a message published again under a new UUID
// is not.
func MessageUUID(msg *message.Message) (string, error) {
	if msg.UUID == "" {
		return "", fmt.Errorf("%w: empty UUID", ErrNoKey)
	}
	return msg.UUID, nil
}

// KeyFromMetadata keys a message by its metadata field, for publishers
// that put a business key there (an order id, say) so that two messages
// about the same thing under different UUIDs are duplicates.
func KeyFromMetadata(field string) KeyFunc {
	return func(msg *message.Message) (string, error) {
		if k := msg.Metadata.Get(field); k != "" {
			return k, nil
		}
		return "", fmt.Errorf("%w: no metadata field %q", ErrNoKey, field)
	}
}

// PayloadFingerprint fingerprints a message by the SHA-256 of its payload:
// with it, a message whose key was handled already but whose payload
// differs is refused (client.ErrFingerprintMismatch, a nack) instead of
// being answered with the first message's outcome.
func PayloadFingerprint(msg *message.Message) []byte {
	sum := sha256.Sum256(msg.Payload)
	return sum[:]
}

// DefaultInProgressDelay bounds how long a duplicate whose first run is
// still in progress elsewhere waits before its nack: the registry's
// estimate of the time left (client.InProgressError.RetryAfter), at most
// this, so that a broker that redelivers a nacked message at once does
// not spin on it.
const DefaultInProgressDelay = time.Second

// Option configures New.
type Option func(*Deduplicator)

// WithKey sets how a message's key is found (default MessageUUID).
func WithKey(f KeyFunc) Option { return func(d *Deduplicator) { d.key = f } }

// WithFingerprint claims each key with f(msg), at most 64 bytes (default
// none: any message with the key is a duplicate). See PayloadFingerprint.
func WithFingerprint(f func(msg *message.Message) []byte) Option {
	return func(d *Deduplicator) { d.fingerprint = f }
}

// WithFinal classifies the handler's errors: those for which final
// returns true are stored as the key's final failure, the message acked
// and every duplicate acked without running the handler, as for an error
// marked with client.Final (which is final whatever final says). By
// default only client.Final's errors are.
func WithFinal(final func(err error) bool) Option { return func(d *Deduplicator) { d.final = final } }

// WithConsumerOptions passes options to the client.Consumer the
// middleware handles messages with: client.WithLease,
// client.WithRetention, client.WithKind, client.WithBookkeepingTimeout,
// and client.WithInProgressWait (or WithWaitInProgress) to make a
// duplicate wait for the first run's outcome instead of being nacked.
func WithConsumerOptions(opts ...client.ConsumerOption) Option {
	return func(d *Deduplicator) { d.consumerOpts = append(d.consumerOpts, opts...) }
}

// WithInProgressDelay sets the longest wait before the nack of a duplicate
// whose first run is in progress elsewhere (default
// DefaultInProgressDelay); zero or less nacks at once, for a subscriber
// that delays redeliveries on its own (watermill-nats' NakDelay, say).
func WithInProgressDelay(limit time.Duration) Option {
	return func(d *Deduplicator) { d.inProgressDelay = limit }
}

// WithLogger receives the middleware's logs (default: none): final
// failures, stored and replayed, and produced messages too large to store.
func WithLogger(l wm.LoggerAdapter) Option { return func(d *Deduplicator) { d.logger = l } }

// Deduplicator runs a Watermill handler once per key of a registry
// consumer. Its Middleware is a message.HandlerMiddleware.
type Deduplicator struct {
	cons            *client.Consumer
	consumer        string
	key             KeyFunc
	fingerprint     func(*message.Message) []byte
	final           func(error) bool
	consumerOpts    []client.ConsumerOption
	inProgressDelay time.Duration
	logger          wm.LoggerAdapter
}

// New returns a Deduplicator of the registry consumer named consumer (a
// name per handler: "billing.payment-worker"), handling messages through
// c.Consumer. Close it when the router has stopped.
func New(c *client.Client, consumer string, opts ...Option) *Deduplicator {
	d := &Deduplicator{
		consumer:        consumer,
		key:             MessageUUID,
		final:           func(error) bool { return false },
		inProgressDelay: DefaultInProgressDelay,
		logger:          wm.NopLogger{},
	}
	for _, o := range opts {
		o(d)
	}
	d.cons = c.Consumer(consumer, d.consumerOpts...)
	return d
}

// Close sends what the Consumer holds, within ctx. The middleware waits
// for each message's Complete before it returns, so there is usually
// nothing to send.
func (d *Deduplicator) Close(ctx context.Context) error { return d.cons.Close(ctx) }

type attemptKey struct{}

// AttemptFromContext returns the claim the handler runs under, from the
// context of the message it was given (msg.Context()). Make the effect
// conditional on Attempt.Token (a fenced write), and expect part of the
// work done already when Attempt.Attempt is above 1: an earlier holder's
// lease ran out, or it failed and released the key.
func AttemptFromContext(ctx context.Context) (client.Attempt, bool) {
	a, ok := ctx.Value(attemptKey{}).(client.Attempt)
	return a, ok
}

// Middleware runs h at most once to completion per key:
//
//   - A new key: h runs, with the message's context cancelled should the
//     registry report another holder took the key over (cause
//     client.ErrLeaseLost). h returned nil: its produced messages are
//     stored with the outcome, and returned (the router publishes them,
//     then acks) only once the outcome is durable. h returned a final
//     error (client.Final, or WithFinal): the failure is stored, and the
//     message acked. h returned another error, or panicked: the key is
//     released and the error returned (the router nacks, the broker
//     redelivers, h runs again with Attempt above 1).
//   - A key already completed: h does not run; the first run's produced
//     messages are returned (published again, with their first UUIDs), or
//     nothing after a stored final failure; the router acks.
//   - A key in progress elsewhere: after the registry's RetryAfter (at
//     most WithInProgressDelay) the *client.InProgressError is returned
//     and the router nacks; with client.WithInProgressWait the duplicate
//     waits for the outcome instead.
//   - A parked key: a *client.ParkedError (client.ErrParked), a nack: send
//     it to a poison queue (middleware.PoisonQueueWithFilter).
//   - The outcome could not be stored, or the registry is unreachable: the
//     error, a nack.
func (d *Deduplicator) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		key, err := d.key(msg)
		if err == nil && key == "" {
			err = ErrNoKey
		}
		if err != nil {
			return nil, err
		}
		var opts []client.OnceOption
		if d.fingerprint != nil {
			opts = append(opts, client.WithMessageFingerprint(d.fingerprint(msg)))
		}
		opts = append(opts, client.WithResultType(ResultType))

		ctx := msg.Context()
		var produced []*message.Message
		var tooLarge int
		res, done, err := d.cons.Handle(ctx, key, func(hctx context.Context, a client.Attempt) ([]byte, error) {
			msg.SetContext(context.WithValue(hctx, attemptKey{}, a))
			defer msg.SetContext(ctx)
			out, herr := h(msg)
			if herr != nil {
				if d.final(herr) {
					herr = client.Final(herr)
				}
				return nil, herr
			}
			produced = out
			data, n, err := encodeMessages(out)
			if err != nil {
				// Nothing stored could replay them: let the message be
				// retried rather than store what would lose them.
				return nil, err
			}
			tooLarge = n
			return data, nil
		}, opts...)

		// Ack only once the outcome is durable: Wait sends the held
		// Complete now (the router acks this message before it takes the
		// next, so no Claim would come to carry it) and resolves within the
		// bookkeeping timeout, even when the message's context ends.
		if _, werr := done.Wait(context.WithoutCancel(ctx)); werr != nil {
			return nil, d.nack(ctx, werr)
		}
		fields := wm.LogFields{"consumer": d.consumer, "key": key, "message_uuid": msg.UUID}
		switch {
		case res.Replayed && err != nil:
			// A stored final failure: done already, nothing to publish.
			d.logger.Info("idemreg: replayed a final failure; message acked without running the handler", fields)
			return nil, nil
		case res.Replayed:
			out, omitted, derr := decodeMessages(res.Data)
			if derr != nil {
				return nil, derr
			}
			if omitted > 0 {
				d.logger.Info("idemreg: replayed an outcome whose produced messages were too large to store; none published", fields.Add(wm.LogFields{"omitted": omitted}))
			}
			return out, nil
		case err != nil:
			// Done is nil and err is h's: a final failure, now stored.
			d.logger.Error("idemreg: final failure stored; message acked", err, fields)
			return nil, nil
		default:
			if tooLarge > 0 {
				d.logger.Info("idemreg: produced messages too large to store; duplicates will publish none", fields.Add(wm.LogFields{"omitted": tooLarge}))
			}
			return produced, nil
		}
	}
}

// nack is the error that makes the router nack: for a key in progress
// elsewhere, after a pause so that a broker redelivering at once does not
// spin.
func (d *Deduplicator) nack(ctx context.Context, err error) error {
	var ip *client.InProgressError
	if !errors.As(err, &ip) || d.inProgressDelay <= 0 {
		return err
	}
	t := time.NewTimer(min(ip.RetryAfter, d.inProgressDelay))
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	return err
}
