package idemhttp_test

import (
	"context"
	"log"
	"net/http"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/client/idemhttp"
)

type accountKey struct{}

// authenticate stands for the service's own authentication: it names the
// caller in the request's context, or answers 401 itself.
func authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		account := r.Header.Get("X-Account") // a verified token's subject, in a real service
		if account == "" {
			w.Header().Set("WWW-Authenticate", `Bearer realm="payments"`)
			http.Error(w, "sign in", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), accountKey{}, account)))
	})
}

// Keys are scoped by the authenticated account, as Stripe scopes them:
// one account's Idempotency-Key never replays, nor reveals, another's. The
// middleware runs after the authentication that names the account.
func ExampleMiddleware() {
	registry, err := grpc.NewClient("127.0.0.1:7350", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	reg := client.New(registry)

	idem := idemhttp.Middleware(reg,
		idemhttp.ScopeBy(func(r *http.Request) string {
			account, _ := r.Context().Value(accountKey{}).(string)
			return account // "" is refused with 401, never served unscoped
		}),
		idemhttp.WithConsumer("payments-api"),
		idemhttp.WithKeyRequired())

	mux := http.NewServeMux()
	mux.Handle("POST /charges", authenticate(idem(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a, _ := idemhttp.AttemptFrom(r.Context()) // a.Token fences the charge's write
		_ = a
		w.WriteHeader(http.StatusCreated)
	}))))
	// http.ListenAndServe(":8080", mux)
}

// An API that only one trusted internal service calls may share one key
// space among its callers, by saying so.
func ExampleUnscoped() {
	registry, err := grpc.NewClient("127.0.0.1:7350", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	idem := idemhttp.Middleware(client.New(registry), idemhttp.Unscoped(), idemhttp.WithConsumer("ledger-internal"))
	_ = idem
}
