package adversarial

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// attackCase is one attack: run asserts the bound it expects (its doc
// comment states it) and leaves serve serving.
type attackCase struct {
	name string
	run  func(t *testing.T, s *suite)
}

// cases run in this order against one serve; each leaves nothing held
// (connections closed, waiters answered) for the next.
var cases = []attackCase{
	{"malformed frames", malformedFrames},
	{"header bombs", headerBombs},
	{"slowloris: silent and dripping connections", slowlorisConnections},
	{"slowloris: streams whose message never comes", slowlorisStreams},
	{"held headers memory (finding 1)", heldHeadersMemory},
	{"forged claim secrets", forgedClaimSecrets},
	{"forged page tokens", forgedPageTokens},
	{"cross-tenant calls", crossTenant},
	{"batch item refusal hides nothing (finding 4)", batchItemRefusal},
	{"control characters in results (finding 10)", controlCharactersInResults},
	{"refusal flood, sampled logs (finding 9)", refusalFlood},
	{"refusal flood of an identity, held (issue 35, weakness 8)", identityRefusalFlood},
	{"refusal flood of a source without credentials, held (issue 35, weakness 8)", sourceRefusalFlood},
	{"replayed peer Wake (issue 35, weakness 3)", wakeReplay},
	// Before finding 2's case: alpha's invented consumers take its share of
	// followed consumers, and alpha.quota would be refused from then on.
	{"concurrent batches do not overshoot a quota (finding 5)", concurrentBatchQuota},
	{"invented consumers cannot switch quotas off (finding 2)", inventedConsumers},
	{"one identity cannot take every wait slot (finding 3)", waitFlood},
	{"claim-key rotation (finding 6)", claimKeyRotation},
	{"HTTP listener caps (finding 7)", httpListenerCaps},
	{"HTTP API compression bomb (issue 35, vulnerability 1)", httpCompressionBomb},
	{"HTTP API JSON that does not decode (issue 35, weakness 1)", httpBadJSON},
	{"calls with no request message (issue 35, weakness 2)", emptyMessages},
	{"console sign-in (finding 8)", consoleSignIn},
	{"console proxy sign-in from a port-forward (issue 35, weakness 4)", consoleProxyPortForward},
	{"config file written in place in two parts (issue 35, weakness 6)", configWrittenInPlace},
	{"claim-key rotation shorter than a lease (issue 35, weakness 7)", shortClaimKeyRotation},
	{"idemhttp: one caller cannot replay another's response (issue 35, vulnerability 3)", idemhttpCrossCaller},
	{"TLS: HTTP/2 flood on the HTTP side (issue 35, vulnerability 2)", tlsHTTP2Flood},
	{"idle keep-alive flood on the HTTP API (issue 35, weakness 5)", keepAliveFlood},
	{"slowloris of one source while another dials (issue 35, weakness 5)", sniffingSlowloris},
	{"health probe under a flood of one source (issue 35, weakness 5)", healthProbeUnderFlood},
}

// TestAdversarial starts one serve and runs every attack of cases against
// it in turn. After each, serve must still serve both tenants; at the end,
// every Complete the neighbour was acknowledged during the whole run must
// replay, and serve must have logged no data race and no panic.
func TestAdversarial(t *testing.T) {
	s := startSuite(t)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.run(t, s)
			s.requireServing(t)
		})
	}
	s.neighbour.mu.Lock()
	acked := append([]ack(nil), s.neighbour.acked...)
	s.neighbour.mu.Unlock()
	s.neighbour.requireReplayed(t, acked)
	t.Logf("%d acknowledged Completes of the neighbour replayed at the end", len(acked))
	s.logs.mu.Lock()
	defer s.logs.mu.Unlock()
	require.Empty(t, s.logs.problems, "serve logged a data race or a panic")
}
