package watermill_test

import (
	"context"
	"errors"
	"log"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"google.golang.org/grpc"

	"github.com/idemreg/idemreg/client"
	idemwm "github.com/idemreg/idemreg/client/watermill"
)

// A payment handler run once per order: keyed by the "order_id" metadata
// field, its receipt replayed to duplicates, a message without the field
// or with a parked key set aside on a poison topic.
func Example() {
	conn, err := grpc.NewClient("127.0.0.1:7350", client.DialOptions()...)
	if err != nil {
		log.Fatal(err)
	}
	reg := client.New(conn)
	logger := wm.NewStdLogger(false, false)
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger) // your broker's subscriber and publisher

	dedup := idemwm.New(reg, "billing.payment-worker",
		idemwm.WithKey(idemwm.KeyFromMetadata("order_id")),
		idemwm.WithConsumerOptions(client.WithLease(time.Minute)),
		idemwm.WithLogger(logger))
	defer dedup.Close(context.Background())

	poison, err := middleware.PoisonQueueWithFilter(pubSub, "orders.poison", func(err error) bool {
		return errors.Is(err, idemwm.ErrNoKey) || errors.Is(err, client.ErrParked)
	})
	if err != nil {
		log.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	h := router.AddHandler("payments", "orders", pubSub, "receipts", pubSub,
		func(msg *message.Message) ([]*message.Message, error) {
			a, _ := idemwm.AttemptFromContext(msg.Context())
			// Charge with a.Token as the fence (or the order id as the
			// provider's idempotency key); a plain error is retried, an
			// error marked with client.Final is stored and acked.
			_ = a
			return []*message.Message{message.NewMessage(wm.NewUUID(), []byte("receipt"))}, nil
		})
	// First added, outermost: the poison queue sees the middleware's errors.
	h.AddMiddleware(poison, dedup.Middleware)
	_ = router.Run(context.Background())
}
