package console_test

import (
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

var selectBox = regexp.MustCompile(`<input type="checkbox" name="select" value="([^"]*)"`)

// TestConsoleBulk: records selected on the records page are released or
// invalidated after one confirmation, each by a call of its own with the
// token the operator saw: one audit event per record, and a record
// someone acted on since is refused alone.
func TestConsoleBulk(t *testing.T) {
	for _, action := range []string{"invalidate", "release"} {
		t.Run(action, func(t *testing.T) {
			e := setup(t, true)
			keys := []string{"charge:1", "charge:2", "charge:3"}
			for _, k := range keys {
				e.park(t, consumer, k, "w-"+k, "timeout after send")
			}
			c := e.signIn(t, oncallToken)
			_, body := get(t, c, e.console.URL+"/records")
			var selected []string
			for _, m := range selectBox.FindAllStringSubmatch(body, -1) {
				v := htmlUnescape(m[1])
				if !strings.Contains(v, "charge%3A3") {
					selected = append(selected, v)
				}
			}
			require.Len(t, selected, 2)
			form := formFields(t, body, "bulk-form")
			form["select"] = selected
			form.Set("action", action)
			form.Set("reason", "incident OPS-77")

			// Someone acts on charge:2 between the listing and the confirmation.
			_, err := idemregv1.NewAdminServiceClient(e.conn).InvalidateRecord(oncall(t), &idemregv1.InvalidateRecordRequest{Consumer: consumer,
				Kind: idemregv1.Kind_KIND_OPERATION, Key: "charge:2", Token: e.inspect(t, "charge:2").GetToken(), Reason: "someone else"})
			require.NoError(t, err)
			audited := func() (ok, refused int) {
				for _, l := range e.logs.lines(t, "admin action") {
					if l["reason"] != "incident OPS-77" || l["identity"] != "oncall" {
						continue
					}
					if l["result"] == "ok" {
						ok++
					} else {
						refused++
					}
				}
				return ok, refused
			}

			code, body := post(t, c, e.console.URL+"/bulk", form)
			require.Equal(t, http.StatusOK, code, body)
			require.Contains(t, body, "Confirm: ")
			require.Contains(t, body, "2 records")
			ok, refused := audited()
			require.Zero(t, ok+refused, "nothing done before the confirmation")

			confirm := formFields(t, body, "bulk-confirm-form")
			confirm["select"] = nil
			for _, m := range regexp.MustCompile(`<input type="hidden" name="select" value="([^"]*)">`).FindAllStringSubmatch(body, -1) {
				confirm.Add("select", htmlUnescape(m[1]))
			}
			require.Equal(t, "yes", confirm.Get("confirm"))
			code, body = post(t, c, e.console.URL+"/bulk", confirm)
			require.Equal(t, http.StatusOK, code, body)
			require.Contains(t, body, "1 of 2 records done")
			require.Contains(t, body, "Someone acted first", "charge:2 changed since it was listed")

			ok, refused = audited()
			require.Equal(t, 1, ok, "one audit event for the record done")
			require.Equal(t, 1, refused, "and one for the record refused")
			require.Equal(t, idemregv1.State_STATE_IN_PROGRESS, e.inspect(t, "charge:1").GetState())
			require.Equal(t, idemregv1.State_STATE_PARKED, e.inspect(t, "charge:3").GetState(), "not selected, untouched")
		})
	}
	t.Run("refused forms", func(t *testing.T) {
		e := setup(t, true)
		e.park(t, consumer, "charge:1", "w", "timeout")
		c := e.signIn(t, oncallToken)
		_, body := get(t, c, e.console.URL+"/records")
		good := formFields(t, body, "bulk-form")
		good.Set("select", htmlUnescape(selectBox.FindStringSubmatch(body)[1]))
		good.Set("action", "invalidate")
		good.Set("reason", "r")
		for name, change := range map[string]func(url.Values){
			"no selection": func(v url.Values) { v.Del("select") },
			"no reason":    func(v url.Values) { v.Del("reason") },
			"bad action":   func(v url.Values) { v.Set("action", "delete") },
			"bad record":   func(v url.Values) { v.Set("select", "consumer=x&kind=KIND_OPERATION&key=k&token=0") },
			"too many": func(v url.Values) {
				for i := 0; i <= 100; i++ {
					v.Add("select", "consumer=x&kind=KIND_OPERATION&key=k"+strings.Repeat("x", i)+"&token=1")
				}
			},
		} {
			t.Run(name, func(t *testing.T) {
				form := url.Values{}
				for k, v := range good {
					form[k] = append([]string(nil), v...)
				}
				change(form)
				form.Set("confirm", "yes")
				code, body := post(t, c, e.console.URL+"/bulk", form)
				require.Equal(t, http.StatusBadRequest, code, body)
				require.Contains(t, body, "Nothing done")
			})
		}
		require.Equal(t, idemregv1.State_STATE_PARKED, e.inspect(t, "charge:1").GetState())
		_, otherBody := get(t, e.signIn(t, oncallToken), e.console.URL+"/records")
		good.Set("confirm", "yes")
		requireForgeriesRefused(t, e, c, "/bulk", good, formFields(t, otherBody, "bulk-form").Get("csrf"))
		require.Equal(t, idemregv1.State_STATE_PARKED, e.inspect(t, "charge:1").GetState(), "no forgery acted")
	})
}
