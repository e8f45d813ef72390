package policy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/idemreg/idemreg/storage"
	"go.yaml.in/yaml/v3"
)

// The file format, YAML or JSON (a JSON document is YAML too):
//
//	defaults:                      # optional: overrides the server's flags
//	  lease:               {default: 30s, min: 1s, max: 1h}
//	  max_lease_total:     24h         # one attempt's Claim and Extends together
//	  message_retention:   {default: 7d,  min: 1h, max: 30d}
//	  operation_retention: {default: 24h, min: 1m, max: 30d}
//	  max_records:         1000000     # quotas of each consumer (0: none, the default)
//	  max_bytes:           1073741824
//	  max_attempts:        5           # acquisitions of a key before a Claim parks it (0: unbounded, the default)
//	consumers:
//	  - name: billing.payment-worker   # an exact consumer name...
//	    operation_retention: {default: 3d, min: 2d}
//	  - prefix: orders.                # ...or a prefix; the longest wins
//	    message_retention: {min: 8d, default: 10d}
//
// The same file may hold the identities and rate_limits sections of
// server/access, which that package reads. Every field is optional. A
// consumer's entry inherits what it leaves out
// from defaults, which inherits from the server's flags. Unknown fields are
// errors, so that a misspelt bound cannot be silently ignored.
type file struct {
	Sections `yaml:",inline"`
	// Sections of the same file that server/access owns and checks.
	Identities yaml.Node `yaml:"identities"`
	RateLimits yaml.Node `yaml:"rate_limits"`
}

// Sections are the sections of the config file this package owns, as
// decoded. server/configfile decodes them together with the sections of
// server/access in one pass over the file, so that one read of the file
// gives both parts.
type Sections struct {
	Defaults  fileBounds     `yaml:"defaults"`
	Consumers []fileConsumer `yaml:"consumers"`
}

type fileBounds struct {
	Lease              *fileRange `yaml:"lease"`
	MaxLeaseTotal      *duration  `yaml:"max_lease_total"`
	MessageRetention   *fileRange `yaml:"message_retention"`
	OperationRetention *fileRange `yaml:"operation_retention"`
	MaxRecords         *int64     `yaml:"max_records"`
	MaxBytes           *int64     `yaml:"max_bytes"`
	MaxAttempts        *int64     `yaml:"max_attempts"`
}

type fileConsumer struct {
	Name       string `yaml:"name"`
	Prefix     string `yaml:"prefix"`
	fileBounds `yaml:",inline"`
}

type fileRange struct {
	Default *duration `yaml:"default"`
	Min     *duration `yaml:"min"`
	Max     *duration `yaml:"max"`
}

// duration is a duration in a policy file: a string such as "30s", "12h"
// or "7d".
type duration struct{ d time.Duration }

func (d *duration) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode || n.Tag != "!!str" {
		return fmt.Errorf("line %d: a duration is a string with a unit, like \"30s\", \"12h\" or \"7d\"; got %q", n.Line, n.Value)
	}
	v, err := ParseDuration(n.Value)
	if err != nil {
		return fmt.Errorf("line %d: %w", n.Line, err)
	}
	d.d = v
	return nil
}

// apply overrides the bounds of b that r sets.
func (r *fileRange) apply(b Bounds) Bounds {
	if r == nil {
		return b
	}
	if r.Default != nil {
		b.Default = r.Default.d
	}
	if r.Min != nil {
		b.Min = r.Min.d
	}
	if r.Max != nil {
		b.Max = r.Max.d
	}
	return b
}

func (f fileBounds) apply(p Policy, source string) Policy {
	p.Source = source
	p.Lease = f.Lease.apply(p.Lease)
	if f.MaxLeaseTotal != nil {
		p.MaxLeaseTotal = f.MaxLeaseTotal.d
	}
	p.MessageRetention = f.MessageRetention.apply(p.MessageRetention)
	p.OperationRetention = f.OperationRetention.apply(p.OperationRetention)
	if f.MaxRecords != nil {
		p.MaxRecords = *f.MaxRecords
	}
	if f.MaxBytes != nil {
		p.MaxBytes = *f.MaxBytes
	}
	if f.MaxAttempts != nil {
		p.MaxAttempts = *f.MaxAttempts
	}
	return p
}

// Parse reads a policy file. base is the policy the file's defaults
// override: the server's flags. Every error is reported, each saying where.
func Parse(data []byte, base Policy) (*Set, error) {
	var f file
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	switch err := dec.Decode(&f); {
	case errors.Is(err, io.EOF): // an empty file: the defaults alone
	case err != nil:
		return nil, cleanYAMLError(err)
	default:
		var extra yaml.Node
		if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
			return nil, errors.New("the file holds more than one YAML document")
		}
	}
	return f.Sections.Build(base)
}

// Build checks the decoded sections over base (the server's flags) and
// returns their set. Every error is reported, each saying where.
func (f Sections) Build(base Policy) (*Set, error) {
	var errs []error
	defaults := f.Defaults.apply(base, DefaultsSource)
	if err := defaults.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("defaults: %w", err))
	}
	set := &Set{defaults: defaults, exact: map[string]Policy{}}
	seen := map[string]int{}
	for i, c := range f.Consumers {
		where := fmt.Sprintf("consumers[%d]", i)
		var source, id string
		switch {
		case (c.Name == "") == (c.Prefix == ""):
			errs = append(errs, fmt.Errorf("%s: needs exactly one of name or prefix", where))
			continue
		case c.Name != "":
			source, id = fmt.Sprintf("consumer %q", c.Name), "name "+c.Name
			if err := checkConsumer(c.Name); err != nil {
				errs = append(errs, fmt.Errorf("%s: name: %w", where, err))
				continue
			}
		default:
			source, id = fmt.Sprintf("prefix %q", c.Prefix), "prefix "+c.Prefix
			if err := checkConsumer(c.Prefix); err != nil {
				errs = append(errs, fmt.Errorf("%s: prefix: %w", where, err))
				continue
			}
		}
		if j, dup := seen[id]; dup {
			errs = append(errs, fmt.Errorf("%s: %s is already given by consumers[%d]", where, source, j))
			continue
		}
		seen[id] = i
		p := c.fileBounds.apply(defaults, source)
		if err := p.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", where, err))
			continue
		}
		if c.Name != "" {
			set.exact[c.Name] = p
		} else {
			set.prefixes = append(set.prefixes, prefixPolicy{prefix: c.Prefix, policy: p})
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	set.sortPrefixes()
	return set, nil
}

// Load reads and parses the policy file at path.
func Load(path string, base Policy) (*Set, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("policy file: %w", err)
	}
	set, err := Parse(data, base)
	if err != nil {
		return nil, fmt.Errorf("policy file %s: %w", path, err)
	}
	return set, nil
}

func checkConsumer(s string) error {
	if err := storage.CheckConsumer(s); err != nil {
		return fmt.Errorf("%q: %w", s, err)
	}
	return nil
}

func cleanYAMLError(err error) error { return CleanYAMLError(err) }

// CleanYAMLError drops the library's "yaml: " prefixes, which say nothing
// to an operator, names unknown fields plainly whichever package's type
// they were decoded into, and keeps the line numbers.
func CleanYAMLError(err error) error {
	msg := strings.ReplaceAll(err.Error(), "yaml: ", "")
	msg = strings.ReplaceAll(msg, "unmarshal errors:\n  ", "")
	msg = unknownField.ReplaceAllString(msg, `unknown field "$1"`)
	msg = wrongShape.ReplaceAllStringFunc(msg, func(m string) string {
		sub := wrongShape.FindStringSubmatch(m)
		return "expected " + shapes[sub[2]] + ", found a YAML " + sub[1]
	})
	return errors.New(msg)
}

var (
	unknownField = regexp.MustCompile(`field (\S+) not found in type \w+\.\w+`)
	wrongShape   = regexp.MustCompile(`cannot unmarshal !!(\w+)(?: [^ ]+)? into (\[\]policy\.fileConsumer|policy\.\w+|configfile\.file|string)`)
	shapes       = map[string]string{
		"policy.file":           "a mapping with defaults and consumers",
		"configfile.file":       "a mapping of sections (defaults, consumers, identities, rate_limits)",
		"[]policy.fileConsumer": "a list of consumer entries",
		"policy.fileConsumer":   "a consumer entry (a mapping with name or prefix)",
		"policy.fileBounds":     "a mapping with lease, max_lease_total, message_retention, operation_retention, max_records, max_bytes and max_attempts",
		"policy.fileRange":      "a mapping with default, min and max",
		"string":                "a string",
	}
)
