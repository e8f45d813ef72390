// Command payments shows UnaryClientInterceptor: a caller charges a small
// gRPC payment provider so that every logical payment is executed once,
// however often replies are lost and calls retried. The provider itself
// gives its Charge RPC Stripe-like idempotency with UnaryServerInterceptor.
//
//	payments provider [-listen 127.0.0.1:7400] [-registry 127.0.0.1:7350] [-drop-every N]
//	payments charge   [-provider 127.0.0.1:7400] [-registry 127.0.0.1:7350] -op ID -account A -amount N [-currency EUR]
//
// Both need a running registry (go run ./cmd/idemreg serve). See
// examples/README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/idemreg/idemreg/client"
	paymentsv1 "github.com/idemreg/idemreg/examples/proto/payments/v1"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "provider":
		err = runProvider(ctx, os.Args[2:])
	case "charge":
		err = runCharge(ctx, os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "payments:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: payments provider|charge [flags]; payments provider -h and payments charge -h list the flags")
	os.Exit(2)
}

func dialRegistry(addr string) (*client.Client, func() error, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	return client.New(conn), conn.Close, nil
}

func runProvider(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("provider", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:7400", "address to serve the PaymentService on")
	registry := fs.String("registry", "127.0.0.1:7350", "idemreg registry address")
	dropEvery := fs.Int64("drop-every", 0, "lose the reply of every Nth call after it ran (0: never), to show retries")
	_ = fs.Parse(args)

	reg, closeReg, err := dialRegistry(*registry)
	if err != nil {
		return err
	}
	defer func() { _ = closeReg() }()
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	p := &Provider{}
	srv, _ := newProviderServer(p, reg, *dropEvery)
	fmt.Printf("provider listening on %s\n", lis.Addr())
	go func() {
		<-ctx.Done()
		srv.GracefulStop()
	}()
	if err := srv.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	fmt.Printf("provider executed %d charges\n", p.Executed())
	return nil
}

func runCharge(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("charge", flag.ExitOnError)
	provider := fs.String("provider", "127.0.0.1:7400", "payment provider address")
	registry := fs.String("registry", "127.0.0.1:7350", "idemreg registry address")
	op := fs.String("op", "", "operation id of the payment: reuse it to retry the same payment (required)")
	account := fs.String("account", "", "account to charge (required; names starting with \"declined\" are declined)")
	amount := fs.Int64("amount", 0, "amount in minor units (required)")
	currency := fs.String("currency", "EUR", "ISO 4217 currency")
	attempts := fs.Int("attempts", 10, "tries before giving up")
	timeout := fs.Duration("attempt-timeout", 2*time.Second, "deadline of each try")
	_ = fs.Parse(args)
	if *op == "" || *account == "" || *amount <= 0 {
		fs.Usage()
		return errors.New("-op, -account and -amount are required")
	}

	reg, closeReg, err := dialRegistry(*registry)
	if err != nil {
		return err
	}
	defer func() { _ = closeReg() }()
	conn, err := grpc.NewClient(*provider, grpc.WithTransportCredentials(insecure.NewCredentials()), chargeInterceptor(reg))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()

	c := &Charger{API: paymentsv1.NewPaymentServiceClient(conn), Attempts: *attempts, AttemptTimeout: *timeout}
	res, err := c.Charge(ctx, *op, &paymentsv1.ChargeRequest{Account: *account, AmountMinor: *amount, Currency: *currency})
	if err != nil {
		st := status.Convert(err)
		return fmt.Errorf("op %s: %s: %s (replayed=%v attempts=%d)", *op, st.Code(), st.Message(), res.Replayed, res.Attempts)
	}
	r := res.Response
	fmt.Printf("op=%s charge_id=%s account=%s amount=%d %s replayed=%v attempts=%d\n",
		*op, r.GetChargeId(), r.GetAccount(), r.GetAmountMinor(), r.GetCurrency(), res.Replayed, res.Attempts)
	return nil
}
