package adversarial

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/client"
	"github.com/idemreg/idemreg/client/idemhttp"
)

// idemhttpCallers are the HTTP API's callers, by the token its own
// authentication takes (not the registry's: the API reaches serve as beta).
var idemhttpCallers = map[string]string{"alice-http-token": "alice", "bob-http-token": "bob", "mallory-http-token": "mallory"}

// idemhttpCrossCaller (issue 35, vulnerability 3): an HTTP API behind
// client/idemhttp, scoped by its authenticated caller, on serve as tenant
// beta. Bob sends alice's Idempotency-Keys with her bodies, mallory with
// other bodies; a caller the API's authentication does not know sends keys with
// no caller; two scopes whose ":"-joined (scope, key) pairs are the same
// string send their keys. Bound: every one of their requests runs as
// their own (never Idempotent-Replayed, never a 422 that would tell them
// the key was used) and alice's retries still get her responses; a request with no
// caller is 401 and claims nothing in serve; the two scopes get two records.
func idemhttpCrossCaller(t *testing.T, s *suite) {
	conn, err := grpc.NewClient(s.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(client.InsecureBearerToken(betaToken)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	reg := client.New(conn)
	const consumer = "beta.http"

	var runs atomic.Int64
	caller := func(r *http.Request) string {
		if c, ok := idemhttpCallers[strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")]; ok {
			return c
		}
		return r.Header.Get("X-Raw-Scope") // the collision pair's scopes, sent as they are
	}
	h := idemhttp.Middleware(reg, idemhttp.ScopeBy(caller), idemhttp.WithConsumer(consumer))(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			b, _ := io.ReadAll(r.Body)
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "%s:%s", caller(r), b)
		}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	send := func(token, rawScope, key, body string) (int, bool, string) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/charges", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set(idemhttp.KeyHeader, `"`+key+`"`)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		if rawScope != "" {
			req.Header.Set("X-Raw-Scope", rawScope)
		}
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader) == "true", string(b)
	}

	const keys = 50
	for i := range keys {
		st, _, _ := send("alice-http-token", "", fmt.Sprintf("order-%d", i), fmt.Sprintf(`{"amount":%d}`, i))
		require.Equal(t, http.StatusCreated, st)
	}
	for i := range keys {
		key, hers := fmt.Sprintf("order-%d", i), fmt.Sprintf(`{"amount":%d}`, i)
		for _, try := range []struct{ token, body string }{
			{"bob-http-token", hers},               // her key and her body: her response?
			{"mallory-http-token", `{"amount":1}`}, // her key, another body: a 422 saying it was used?
		} {
			st, replayed, got := send(try.token, "", key, try.body)
			require.Equal(t, http.StatusCreated, st, "%s on %s: %s", try.token, key, got)
			require.False(t, replayed, "%s got a replay of %s: %s", try.token, key, got)
			require.Equal(t, idemhttpCallers[try.token]+":"+try.body, got)
		}
		st, replayed, got := send("alice-http-token", "", key, hers)
		require.Equal(t, http.StatusCreated, st)
		require.True(t, replayed, "alice's retry of %s", key)
		require.Equal(t, "alice:"+hers, got)
	}
	require.EqualValues(t, 3*keys, runs.Load(), "alice's 50, bob's 50 with her bodies, mallory's 50 with others")

	// No caller: refused, nothing claimed, neither the bare key nor an
	// empty scope's.
	for _, token := range []string{"", "stolen-or-expired"} {
		st, _, got := send(token, "", "order-0", `{"amount":0}`)
		require.Equal(t, http.StatusUnauthorized, st, "body %s", got)
	}
	for _, k := range []string{"order-0", idemhttp.RegistryKey("", "order-0")} {
		_, err := reg.Lookup(t.Context(), client.Key{Consumer: consumer, Kind: client.KindOperation, Key: k})
		require.ErrorIs(t, err, client.ErrNotFound, "registry key %q", k)
	}

	// "alice:x" + "K" and "alice" + "x:K" are one string joined with ":".
	_, _, first := send("", "alice:x", "K", "{}")
	st, replayed, second := send("", "alice", "x:K", "{}")
	require.Equal(t, http.StatusCreated, st)
	require.False(t, replayed, "scope alice, key x:K got %s", second)
	require.NotEqual(t, first, second)
	for _, k := range []string{idemhttp.RegistryKey("alice:x", "K"), idemhttp.RegistryKey("alice", "x:K")} {
		rec, err := reg.Lookup(t.Context(), client.Key{Consumer: consumer, Kind: client.KindOperation, Key: k})
		require.NoError(t, err)
		require.Equal(t, client.StateCompleted, rec.State)
	}
	t.Logf("%d requests of bob's and mallory's on alice's %d keys each ran as their own; 2 without a caller refused, nothing claimed", 2*keys, keys)
}
