package console_test

import (
	"net/http"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/console"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/resulttype"
	"github.com/idemreg/idemreg/server/servertest"
)

// TestConsoleResolveResponseTypes: the resolve form
// refuses a response whose data does not decode as its known type before
// any confirmation, takes JSON of a known type and stores its wire format,
// and says when a type it does not know goes unchecked.
func TestConsoleResolveResponseTypes(t *testing.T) {
	e := setup(t, true)
	c := e.signIn(t, oncallToken)
	response := func(key, typ, encoding, data string) url.Values {
		return resolveForm(t, e, c, key, url.Values{"reason": {"repair, OPS-24"}, "action": {"complete"}, "outcome": {"response"},
			"type": {typ}, "encoding": {encoding}, "data": {data}})
	}

	e.park(t, consumer, "charge:int", "w", "unknown")
	code, body := post(t, c, e.console.URL+"/resolve", response("charge:int", "google.protobuf.Int64Value", "text", `{"value":10}`))
	require.Equal(t, http.StatusBadRequest, code, body)
	require.Contains(t, body, "does not decode as google.protobuf.Int64Value")
	require.Contains(t, body, "write it as JSON instead")
	require.NotContains(t, body, "Confirm the resolution")
	require.Equal(t, idemregv1.State_STATE_PARKED, e.inspect(t, "charge:int").GetState())

	confirm, body := confirmResolve(t, e, c, response("charge:int", "google.protobuf.Int64Value", "json", `{"value":"10"}`))
	require.Contains(t, body, `<pre id="confirm-result-json">&#34;10&#34;</pre>`, "the confirmation shows the value decoded")
	require.Equal(t, "base64", confirm.Get("encoding"), "the confirmation carries the encoded bytes")
	code, body = post(t, c, e.console.URL+"/resolve", confirm)
	require.Equal(t, http.StatusOK, code, body)
	resp := e.claim(t, "charge:int", "w2").GetRecord().GetResult().GetResponse()
	require.Equal(t, "google.protobuf.Int64Value", resp.GetType())
	var got wrapperspb.Int64Value
	require.NoError(t, proto.Unmarshal(resp.GetData(), &got), "the replay decodes as its type")
	require.EqualValues(t, 10, got.GetValue())

	e.park(t, consumer, "charge:unknown", "w", "unknown")
	code, body = post(t, c, e.console.URL+"/resolve", response("charge:unknown", "payments.v1.Charge", "json", `{"id":"ch_1"}`))
	require.Equal(t, http.StatusBadRequest, code, body)
	require.Contains(t, body, "does not know the type")
	code, body = post(t, c, e.console.URL+"/resolve", response("charge:unknown", "google.protobuf.Int64Value", "json", `{"amount":10}`))
	require.Equal(t, http.StatusBadRequest, code, body)
	require.Contains(t, body, "not google.protobuf.Int64Value in the protobuf JSON mapping")
	_, body = confirmResolve(t, e, c, response("charge:unknown", "payments.v1.Charge", "text", "charge-1"))
	require.Contains(t, body, `id="confirm-result-unchecked"`, "a type the registry does not know is stored unchecked, and the operator is told")
	require.NotContains(t, body, `id="confirm-result-json"`)
}

// TestConsoleResolveDescriptorSet: with the types of a descriptor set, the
// form checks and encodes a type the binary does not link.
func TestConsoleResolveDescriptorSet(t *testing.T) {
	types, err := resulttype.Load(servertest.WriteDescriptorSet(t, servertest.ChargeDescriptorSet()))
	require.NoError(t, err)
	e := setup(t, true, func(c *console.Config) { c.Types = types })
	c := e.signIn(t, oncallToken)
	e.park(t, consumer, "charge:set", "w", "unknown")
	response := func(encoding, data string) url.Values {
		return resolveForm(t, e, c, "charge:set", url.Values{"reason": {"repair"}, "action": {"complete"}, "outcome": {"response"},
			"type": {servertest.ChargeResponse}, "encoding": {encoding}, "data": {data}})
	}
	code, body := post(t, c, e.console.URL+"/resolve", response("text", "charge-1"))
	require.Equal(t, http.StatusBadRequest, code, body)
	require.Contains(t, body, "does not decode as payments.v1.ChargeResponse")

	confirm, body := confirmResolve(t, e, c, response("json", `{"chargeId":"ch_1","amountMinor":"1250"}`))
	require.Contains(t, body, `id="confirm-result-json"`)
	require.Contains(t, body, "ch_1")
	code, body = post(t, c, e.console.URL+"/resolve", confirm)
	require.Equal(t, http.StatusOK, code, body)
	resp := e.claim(t, "charge:set", "w2").GetRecord().GetResult().GetResponse()
	mt, ok := types.Find(servertest.ChargeResponse)
	require.True(t, ok)
	m := mt.New().Interface()
	require.NoError(t, proto.Unmarshal(resp.GetData(), m))
	require.EqualValues(t, 1250, m.ProtoReflect().Get(m.ProtoReflect().Descriptor().Fields().ByName("amount_minor")).Int())
}
