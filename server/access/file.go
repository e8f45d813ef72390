package access

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"regexp"
	"strings"

	"go.yaml.in/yaml/v3"
)

// The sections of the config file (YAML or JSON) that this package owns;
// the file's other sections (the retention policy's "defaults" and
// "consumers", see server/policy) are read by their own packages:
//
//	identities:
//	  - name: billing                     # for logs and metrics: [A-Za-z0-9._-]
//	    uris: ["spiffe://prod.example/ns/billing/sa/payment-worker"]  # URI SANs
//	    dns_names: ["payment-worker.billing.svc"]                     # DNS SANs
//	    subjects: ["CN=payment-worker,O=Example"]                     # as crypto/x509 prints it
//	    token_hashes: ["sha256:3a7bd3e2360a3d29eea436fcfb7e44c735d117c42d1c1835420b6b9942dd4f1b"]
//	    consumers: ["billing.payment-worker", "billing.*"]            # RegistryService
//	    admin: ["billing.*"]                                          # AdminService
//	rate_limits:
//	  - consumers: ["orders.*"]           # the most specific rule wins: name, longest prefix, "*"
//	    rate: 200                         # requests per second, for each consumer
//	    burst: 400                        # default: the rate, at least 1
//	  - identities: ["*"]                 # or identities: a name of this file, or "*"
//	    rate: 1000                        # requests per second, for each identity, all its consumers together
//
// A call passes its identity's bucket and then its consumer's: an identity
// granted a prefix can invent consumer names, each with a fresh bucket, but
// not a fresh identity.
//
// Every field inside these sections is checked: an unknown one is an error,
// so a misspelt grant cannot silently widen or narrow access. A certificate
// identity or a token hash belongs to one identity only.
type file struct {
	Sections `yaml:",inline"`
	// Others are the sections other packages own.
	Others map[string]yaml.Node `yaml:",inline"`
}

// Sections are the sections of the config file this package owns, as
// decoded. server/configfile decodes them together with the sections of
// server/policy in one pass over the file, so that one read of the file
// gives both parts.
type Sections struct {
	Identities []fileIdentity  `yaml:"identities"`
	RateLimits []fileRateLimit `yaml:"rate_limits"`
}

type fileIdentity struct {
	Name        string   `yaml:"name"`
	URIs        []string `yaml:"uris"`
	DNSNames    []string `yaml:"dns_names"`
	Subjects    []string `yaml:"subjects"`
	TokenHashes []string `yaml:"token_hashes"`
	Consumers   []string `yaml:"consumers"`
	Admin       []string `yaml:"admin"`
}

type fileRateLimit struct {
	Consumers  []string `yaml:"consumers"`
	Identities []string `yaml:"identities"`
	Rate       float64  `yaml:"rate"`
	Burst      int      `yaml:"burst"`
}

var unknownField = regexp.MustCompile(`field (\S+) not found in type access\.\w+`)

var identityName = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// Parse reads the identities and rate limits of a config file. Every error
// is reported, each saying where.
func Parse(data []byte) (*Set, error) {
	var f file
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	switch err := dec.Decode(&f); {
	case errors.Is(err, io.EOF):
		return Open(), nil
	case err != nil:
		msg := strings.ReplaceAll(err.Error(), "yaml: ", "")
		msg = strings.ReplaceAll(msg, "unmarshal errors:\n  ", "")
		return nil, errors.New(unknownField.ReplaceAllString(msg, `unknown field "$1"`))
	}
	return f.Sections.Build()
}

// Build checks the decoded sections and returns their set. Every error is
// reported, each saying where.
func (f Sections) Build() (*Set, error) {
	var errs []error
	s := &Set{
		byURI:     map[string]*Identity{},
		byDNS:     map[string]*Identity{},
		bySubject: map[string]*Identity{},
		byToken:   map[[32]byte]*Identity{},
	}
	names := map[string]int{}
	owner := map[string]string{} // credential → where it was first given
	claim := func(cred, where string) bool {
		if first, dup := owner[cred]; dup {
			errs = append(errs, fmt.Errorf("%s: already given at %s", where, first))
			return false
		}
		owner[cred] = where
		return true
	}
	for i, fi := range f.Identities {
		where := fmt.Sprintf("identities[%d]", i)
		if !identityName.MatchString(fi.Name) {
			errs = append(errs, fmt.Errorf("%s: name %q: 1-64 bytes of [A-Za-z0-9._-] required", where, fi.Name))
			continue
		}
		where = fmt.Sprintf("identities[%d] (%s)", i, fi.Name)
		if j, dup := names[fi.Name]; dup {
			errs = append(errs, fmt.Errorf("%s: name already used by identities[%d]", where, j))
			continue
		}
		names[fi.Name] = i
		id := &Identity{Name: fi.Name}
		var err error
		if id.consumers, err = parsePatterns(fi.Consumers, "consumers"); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", where, err))
		}
		if id.admin, err = parsePatterns(fi.Admin, "admin"); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", where, err))
		}
		if len(fi.Consumers) == 0 && len(fi.Admin) == 0 {
			errs = append(errs, fmt.Errorf("%s: grants nothing: list consumers, admin or both", where))
		}
		if len(fi.URIs)+len(fi.DNSNames)+len(fi.Subjects)+len(fi.TokenHashes) == 0 {
			errs = append(errs, fmt.Errorf("%s: no credential: give uris, dns_names, subjects or token_hashes", where))
		}
		for j, u := range fi.URIs {
			at := fmt.Sprintf("%s: uris[%d]", where, j)
			if parsed, err := url.Parse(u); err != nil || parsed.Scheme == "" || parsed.String() != u {
				errs = append(errs, fmt.Errorf("%s: %q is not a URI in canonical form, like \"spiffe://example.org/ns/billing/sa/worker\"", at, u))
				continue
			}
			if claim("uri "+u, at) {
				s.byURI[u] = id
			}
		}
		for j, d := range fi.DNSNames {
			at := fmt.Sprintf("%s: dns_names[%d]", where, j)
			if d == "" || strings.ContainsAny(d, " */") {
				errs = append(errs, fmt.Errorf("%s: %q is not a DNS name (wildcards are not matched)", at, d))
				continue
			}
			d = strings.ToLower(d)
			if claim("dns "+d, at) {
				s.byDNS[d] = id
			}
		}
		for j, sub := range fi.Subjects {
			at := fmt.Sprintf("%s: subjects[%d]", where, j)
			if !strings.Contains(sub, "=") {
				errs = append(errs, fmt.Errorf("%s: %q is not a distinguished name like \"CN=worker,O=Example\"", at, sub))
				continue
			}
			if claim("subject "+sub, at) {
				s.bySubject[sub] = id
			}
		}
		for j, th := range fi.TokenHashes {
			at := fmt.Sprintf("%s: token_hashes[%d]", where, j)
			raw, err := hex.DecodeString(strings.TrimPrefix(th, tokenHashPrefix))
			if !strings.HasPrefix(th, tokenHashPrefix) || err != nil || len(raw) != 32 {
				// Never echo the value: someone may have pasted a token here.
				errs = append(errs, fmt.Errorf("%s: not a token hash: write \"sha256:\" and 64 hex digits, as `idemreg new-token` prints", at))
				continue
			}
			if claim("token "+th, at) {
				s.byToken[[32]byte(raw)] = id
			}
		}
		s.identities = append(s.identities, id)
	}
	for i, fr := range f.RateLimits {
		where := fmt.Sprintf("rate_limits[%d]", i)
		if fr.Rate <= 0 {
			errs = append(errs, fmt.Errorf("%s: rate must be a positive number of requests per second, got %v", where, fr.Rate))
			continue
		}
		burst := fr.Burst
		if burst == 0 {
			burst = max(1, int(fr.Rate))
		}
		if burst < 1 {
			errs = append(errs, fmt.Errorf("%s: burst must be at least 1, got %d", where, fr.Burst))
			continue
		}
		switch {
		case len(fr.Consumers) == 0 && len(fr.Identities) == 0:
			errs = append(errs, fmt.Errorf("%s: consumers: list the consumers (or the identities) the limit applies to", where))
		case len(fr.Consumers) > 0 && len(fr.Identities) > 0:
			errs = append(errs, fmt.Errorf("%s: a rule limits consumers or identities, not both: split it in two", where))
			continue
		case len(fr.Identities) > 0 && len(f.Identities) == 0:
			errs = append(errs, fmt.Errorf("%s: identities: the file names no identities (every caller is anonymous)", where))
			continue
		}
		for j, name := range fr.Identities {
			if _, known := names[name]; !known && name != "*" {
				errs = append(errs, fmt.Errorf("%s: identities[%d]: no identity is named %q", where, j, name))
				continue
			}
			if err := s.identityLimits.add(name, Limit{Rate: fr.Rate, Burst: burst, Of: "identities"}); err != nil {
				errs = append(errs, fmt.Errorf("%s: identities[%d]: %w", where, j, err))
			}
		}
		for j, p := range fr.Consumers {
			if err := s.limits.add(p, Limit{Rate: fr.Rate, Burst: burst}); err != nil {
				errs = append(errs, fmt.Errorf("%s: consumers[%d]: %w", where, j, err))
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return s, nil
}

// Load reads and parses the config file at path.
func Load(path string) (*Set, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config file: %w", err)
	}
	s, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	return s, nil
}

// ErrModeChange is what a reload of a config file (server/configfile)
// answers when the file would turn authentication on or off: that takes a
// restart, so that a bad edit cannot open a server to every caller.
var ErrModeChange = errors.New("a reload cannot turn authentication on or off (identities added to or removed from an empty list); restart the server")
