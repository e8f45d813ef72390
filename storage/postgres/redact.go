package postgres

import (
	"net/url"
	"regexp"
	"slices"
	"strings"
)

// Connection strings hold secrets in three places: a URL's password
// (postgres://user:secret@host), a password-like query parameter
// (?password=secret, ?sslpassword=secret) and a key=value string
// (host=db password=secret, password = 'se cret'). An inline client key
// (sslkey=-----BEGIN..., with sslinline) is one too. pgx redacts its parse
// errors only as far as its patterns go (it misses "password = secret"),
// so the store does not rely on it: Redact is what logs and errors print,
// and every error Open and Migrate return has the secrets taken out.

// redacted replaces a secret.
const redacted = "xxxxx"

// secretParams are the parameters whose values are secrets, in a URL's
// query or a key=value string.
var secretParams = map[string]bool{"password": true, "sslpassword": true}

// Patterns for strings that do not parse as URLs, and for key=value
// strings; groups 1 and 3 are kept, group 2 is the secret. They may hide more than
// the secret in a string too broken to tell, never less.
var secretPatterns = []*regexp.Regexp{
	// userinfo of a URL, to the last '@' before whitespace.
	regexp.MustCompile(`(://[^:/?#@\s]*:)(\S*)(@)`),
	// query parameters.
	regexp.MustCompile(`(?i)([?&](?:ssl)?password=)([^&#\s]*)`),
	regexp.MustCompile(`(?i)([?&]sslkey=)((?:-|%2d){5}BEGIN[^&#\s]*)`),
	// key=value: a quoted value (with backslash escapes) or a bare one.
	regexp.MustCompile(`(?i)((?:^|[\s=])(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^'\s]\S*)`),
	regexp.MustCompile(`(?i)((?:^|[\s=])sslkey\s*=\s*)('-----BEGIN(?:[^'\\]|\\.)*'?)`),
}

// Redact returns the connection string conn (a URL or key=value settings)
// with every secret replaced by "xxxxx", for logs and errors. It never
// fails: what it cannot parse it redacts by pattern.
func Redact(conn string) string {
	if u, ok := parseURL(conn); ok {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), redacted)
		}
		parts := strings.Split(u.RawQuery, "&")
		for i, p := range parts {
			k, v, _ := strings.Cut(p, "=")
			if secretQueryParam(k, v) {
				parts[i] = k + "=" + redacted
			}
		}
		u.RawQuery = strings.Join(parts, "&")
		return u.String()
	}
	for _, re := range secretPatterns {
		conn = re.ReplaceAllString(conn, "${1}"+redacted+"${3}")
	}
	return conn
}

// parseURL parses conn when it is a well-formed postgres URL.
func parseURL(conn string) (*url.URL, bool) {
	if !strings.HasPrefix(conn, "postgres://") && !strings.HasPrefix(conn, "postgresql://") {
		return nil, false
	}
	u, err := url.Parse(conn)
	if err != nil {
		return nil, false
	}
	if _, err := url.ParseQuery(u.RawQuery); err != nil {
		return nil, false
	}
	return u, true
}

func secretQueryParam(rawKey, rawValue string) bool {
	k, err := url.QueryUnescape(rawKey)
	if err != nil {
		return true // cannot tell: hide it
	}
	k = strings.ToLower(k)
	if secretParams[k] {
		return true
	}
	v, _ := url.QueryUnescape(rawValue)
	return k == "sslkey" && strings.HasPrefix(v, "-----BEGIN")
}

// secrets returns every form in which conn's secrets may appear in a
// driver's message: as written, unescaped, unquoted.
func secrets(conn string) []string {
	var out []string
	var add func(v string)
	add = func(v string) {
		if v == "" || v == redacted {
			return
		}
		out = append(out, v)
		if d, err := url.PathUnescape(v); err == nil && d != v {
			out = append(out, d)
		}
		if d, err := url.QueryUnescape(v); err == nil && d != v {
			out = append(out, d)
		}
		if len(v) >= 2 && v[0] == '\'' && v[len(v)-1] == '\'' {
			add(strings.NewReplacer(`\'`, `'`, `\\`, `\`).Replace(v[1 : len(v)-1]))
		}
	}
	if u, ok := parseURL(conn); ok {
		if p, has := u.User.Password(); has {
			add(p)
		}
		for k, vs := range u.Query() {
			for _, v := range vs {
				if secretQueryParam(url.QueryEscape(k), url.QueryEscape(v)) {
					add(v)
				}
			}
		}
	}
	for _, re := range secretPatterns {
		for _, m := range re.FindAllStringSubmatch(conn, -1) {
			add(m[2])
		}
	}
	// Longest first, so that a secret containing another is replaced whole.
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out
}

// secretError is an error from the driver with the secrets of the
// connection string it was given taken out of its message; errors.Is and
// errors.As still see the driver's error.
type secretError struct {
	err     error
	secrets []string
}

// withoutSecrets wraps err, if any, so that its message cannot show the
// secrets of conn.
func withoutSecrets(err error, conn string) error {
	if err == nil {
		return nil
	}
	s := secrets(conn)
	if len(s) == 0 {
		return err
	}
	return &secretError{err: err, secrets: s}
}

func (e *secretError) Error() string {
	msg := e.err.Error()
	for _, s := range e.secrets {
		msg = strings.ReplaceAll(msg, s, redacted)
	}
	return msg
}

func (e *secretError) Unwrap() error { return e.err }
