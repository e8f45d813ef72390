package registrytest_test

import (
	"context"
	"fmt"
	"log"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/client/registrytest"
)

// A test starts a registry with Start(t) and uses its Client; outside a
// test, New and Close do the same. Here a message handler runs once for a
// message id, and the redelivery of the message replays the outcome.
func Example() {
	reg, err := registrytest.New()
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Close()

	apply := func(ctx context.Context, a client.Attempt) ([]byte, error) {
		fmt.Println("applying payment-42, attempt", a.Attempt)
		return []byte("applied"), nil
	}
	for range 2 { // the broker delivers the message twice
		res, err := reg.Client.Once(context.Background(), "billing.ledger", "payment-42", apply)
		fmt.Printf("ran=%v replayed=%v data=%s err=%v\n", res.Ran, res.Replayed, res.Data, err)
	}
	// Output:
	// applying payment-42, attempt 1
	// ran=true replayed=false data=applied err=<nil>
	// ran=false replayed=true data=applied err=<nil>
}
