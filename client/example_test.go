package client_test

import (
	"context"
	"log"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/client"
)

// The client interceptor goes on the connection to the downstream; each
// call carries its operation's key in the context.
func ExampleUnaryClientInterceptor() {
	registry, err := grpc.NewClient("127.0.0.1:7350", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	reg := client.New(registry)

	provider, err := grpc.NewClient("payments.internal:443",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(reg,
			client.WithMethods("/payments.v1.PaymentService/Charge"),
			client.WithConsumer("checkout.charges"),
		)))
	if err != nil {
		log.Fatal(err)
	}
	defer provider.Close()

	// For each call: the key of the logical operation, reused on every retry.
	opID := "order-42/charge-1"
	ctx := client.WithIdempotencyKey(context.Background(), "payment:"+opID)
	_ = ctx // paymentsv1.NewPaymentServiceClient(provider).Charge(ctx, req, client.Replayed(&replayed))
}

// The server interceptor gives a service's own RPCs Stripe-like
// idempotency: callers send an idempotency-key metadata.
func ExampleUnaryServerInterceptor() {
	registry, err := grpc.NewClient("127.0.0.1:7350", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		client.UnaryServerInterceptor(client.New(registry),
			client.WithMethods("/payments.v1.PaymentService/Charge"),
			client.WithWaitInProgress(client.Backoff{Initial: 50 * time.Millisecond, Max: time.Second}),
		),
	))
	_ = srv // paymentsv1.RegisterPaymentServiceServer(srv, impl); srv.Serve(lis)
}
