package postgres

import (
	"errors"
	"net/url"
	"strings"
	"testing"
	"unicode"

	"github.com/stretchr/testify/require"
)

// FuzzRedact puts a fuzzed password in each form a connection string can
// carry one, written as a user would (escaped for a URL, quoted for
// key=value when it needs to be): neither Redact nor an error that quotes
// the string, through withoutSecrets, shows it.
func FuzzRedact(f *testing.F) {
	f.Add("S3cretPw")
	f.Add("p@ss:w/rd?&#")
	f.Add("with space's\\")
	f.Add("日本語のパスワード")
	quote := func(pw string) string { return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(pw) + "'" }
	forms := []func(pw string) string{
		func(pw string) string {
			return "postgres://" + url.UserPassword("u", pw).String() + "@db:5432/idemreg?sslmode=disable"
		},
		func(pw string) string {
			return "postgres://u@db/idemreg?sslmode=disable&password=" + url.QueryEscape(pw)
		},
		func(pw string) string {
			return "postgresql://u@db/idemreg?sslpassword=" + url.QueryEscape(pw) + "&connect_timeout=x"
		},
		func(pw string) string { return "host=db user=u password=" + quote(pw) + " sslmode=disable" },
		func(pw string) string { return "host=db user=u password = " + quote(pw) },
		func(pw string) string { return "host=db password=" + pw + " user=u" },
		func(pw string) string { return "host=db password = " + pw },
	}
	f.Fuzz(func(t *testing.T, pw string) {
		if len(pw) < 4 || strings.ContainsFunc(pw, func(r rune) bool { return !unicode.IsPrint(r) || r == unicode.ReplacementChar }) {
			return // too short to tell apart from the rest of the string
		}
		for i, form := range forms {
			if i >= 5 && strings.ContainsAny(pw, " '\\") {
				continue // a bare value has no space, quote or backslash
			}
			conn := form(pw)
			got := Redact(conn)
			msg := withoutSecrets(errors.New("cannot parse `"+conn+"`: failed"), conn).Error()
			// What the answers show whatever the password is, the
			// redaction marker included: a password found there is no leak.
			neutral := form("Q")
			anyway := form("") + redacted + "cannot parse ``: failed" + Redact(neutral) +
				withoutSecrets(errors.New("cannot parse `"+neutral+"`: failed"), neutral).Error()
			for _, shown := range []string{pw, url.QueryEscape(pw), url.PathEscape(pw)} {
				if strings.Contains(anyway, shown) {
					continue // it appears where it is no secret
				}
				require.NotContains(t, got, shown, "Redact(%q)", conn)
				require.NotContains(t, msg, shown, "error for %q", conn)
			}
		}
	})
}
