package client_test

import (
	"context"
	"log"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/client"
)

// A consumer loop that makes one registry round trip per message: each
// message's Complete rides with the next message's Claim, and the message
// is acked once its Done says the outcome is durable.
func ExampleConsumer() {
	registry, err := grpc.NewClient("127.0.0.1:7350", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	reg := client.New(registry)
	ctx := context.Background()

	cons := reg.Consumer("billing.payment-worker")
	defer func() { _ = cons.Close(ctx) }() // sends the Completes it holds

	type message struct {
		id        string
		ack, nack func()
	}
	var inbox <-chan message // the broker's deliveries
	for msg := range inbox {
		_, done, _ := cons.Handle(ctx, msg.id, func(ctx context.Context, a client.Attempt) ([]byte, error) {
			// Apply the payment, fenced by a.Token.
			return nil, nil
		})
		go func() {
			<-done.Ready()
			if done.Err() == nil {
				msg.ack()
			} else {
				msg.nack()
			}
		}()
	}
}
