// Package configfile owns the config file (--config) as a whole: one read
// and one decode of the file per load and per reload, giving the retention
// policy (server/policy) and the identities and rate limits (server/access)
// together, and one swap that replaces both at once or neither.
//
// Each part keeps its own rules in its own package; what this package adds
// is that a file is taken or refused whole. Two parsers reloading on the
// same signal could take the policy part of a file and refuse its access
// part, leaving the server on half of each file.
package configfile

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/policy"
)

// Config is one config file's parts. It is immutable.
type Config struct {
	Policy *policy.Set
	Access *access.Set
	// Version names the file's content: the first 12 hex digits of its
	// SHA-256 (sha256sum FILE | cut -c1-12), so that an operator can tell
	// which file is in force from the logs and the idemreg_config_info
	// metric. Empty without a file.
	Version string
}

// file is every section a config file may hold; an unknown one is an
// error, as an unknown field inside a section is.
type file struct {
	Policy policy.Sections `yaml:",inline"`
	Access access.Sections `yaml:",inline"`
}

// Parse reads a config file: base is the policy its defaults override (the
// server's flags). Errors of both parts are reported together, each saying
// where.
func Parse(data []byte, base policy.Policy) (*Config, error) {
	var f file
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	switch err := dec.Decode(&f); {
	case errors.Is(err, io.EOF): // an empty file: the defaults, no identities
	case err != nil:
		return nil, policy.CleanYAMLError(err)
	default:
		var extra yaml.Node
		if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
			return nil, errors.New("the file holds more than one YAML document")
		}
	}
	pol, perr := f.Policy.Build(base)
	acc, aerr := f.Access.Build()
	if err := errors.Join(perr, aerr); err != nil {
		return nil, err
	}
	return &Config{Policy: pol, Access: acc}, nil
}

// Load reads and parses the config file at path.
func Load(path string, base policy.Policy) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config file: %w", err)
	}
	return parseFile(path, data, base)
}

func parseFile(path string, data []byte, base policy.Policy) (*Config, error) {
	c, err := Parse(data, base)
	if err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	sum := sha256.Sum256(data)
	c.Version = hex.EncodeToString(sum[:6])
	return c, nil
}

// Source is the config in force, read from a file and replaced whole by
// Reload: the one source of the server's policy and access sets, so that a
// request reads both from one snapshot. It is safe for concurrent use.
type Source struct {
	path string
	base policy.Policy
	cur  atomic.Pointer[Config]
	mu   sync.Mutex // serialises reloads

	// Guarded by mu: the digest of the content last read, taken or
	// refused, so that a poll acts once per change; and whether the last
	// poll could not read the file, so that a missing file is said once.
	seen        [sha256.Size]byte
	readFailing bool
	// Guarded by mu: a changed content a poll read and has not taken
	// yet, and when it was first read (ReloadIfChanged's settling).
	pending      [sha256.Size]byte
	pendingSince time.Time
	hasPending   bool
}

// Open loads the config file at path over base and returns the source
// holding it. An invalid file is an error. An empty path is no file: base
// for every consumer and no identities, with nothing to reload.
func Open(path string, base policy.Policy) (*Source, error) {
	if path == "" {
		set, err := policy.NewSet(base)
		if err != nil {
			return nil, err
		}
		return Static(&Config{Policy: set, Access: access.Open()}), nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config file: %w", err)
	}
	c, err := parseFile(path, data, base)
	if err != nil {
		return nil, err
	}
	s := &Source{path: path, base: base, seen: sha256.Sum256(data)}
	s.cur.Store(c)
	return s, nil
}

// Path is the file the source reloads from; empty for a static source.
func (s *Source) Path() string { return s.path }

// Current returns the config in force.
func (s *Source) Current() *Config { return s.cur.Load() }

// Static returns a source that always holds c: no file, nothing to
// reload (tests, and a server given its sets in its Config).
func Static(c *Config) *Source {
	s := &Source{}
	s.cur.Store(c)
	return s
}

// Reload reads the file again. When both parts are valid, and the file does
// not turn authentication on or off, the file replaces the config in force
// in one swap and is returned; otherwise the error says why and nothing
// changes. A static source has nothing to reload and returns its config.
func (s *Source) Reload() (*Config, error) {
	if s.path == "" {
		return s.Current(), nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	data, err := os.ReadFile(s.path)
	if err != nil {
		return nil, fmt.Errorf("config file: %w", err)
	}
	return s.take(data)
}

// ReloadIfChanged is Reload when the file's content differs from the
// content last read (by Open, Reload or ReloadIfChanged, taken or
// refused) and has read the same for at least settle, and nothing
// otherwise: changed says whether it acted. It is what a poll calls, at
// now, so that a file replaced on disk — written in place, renamed over,
// or a Kubernetes ConfigMap's ..data symlink swapped — is taken without a
// signal, and a file refused is refused once, not on every poll. A file
// that cannot be read is reported once, until it can again.
//
// A file written in place is read while it is being written: a first
// write that ends between two identities parses, and taking it would
// leave every identity but the first unauthenticated, and the rate limits
// gone, until the next poll. So a new content is taken only when a poll
// reads the same bytes as a poll at least settle before it, with every
// poll between reading them too; any other bytes start the wait again.
// A writer that pauses for less than settle is never taken half-way.
func (s *Source) ReloadIfChanged(now time.Time, settle time.Duration) (c *Config, changed bool, err error) {
	if s.path == "" {
		return nil, false, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	data, err := os.ReadFile(s.path)
	if err != nil {
		s.hasPending = false
		if s.readFailing {
			return nil, false, nil
		}
		s.readFailing = true
		return nil, true, fmt.Errorf("config file: %w", err)
	}
	s.readFailing = false
	sum := sha256.Sum256(data)
	switch {
	case sum == s.seen:
		s.hasPending = false // written back as it was: nothing to take
		return nil, false, nil
	case !s.hasPending || sum != s.pending:
		s.pending, s.pendingSince, s.hasPending = sum, now, true
		return nil, false, nil
	case now.Sub(s.pendingSince) < settle:
		return nil, false, nil
	}
	s.hasPending = false
	c, err = s.take(data)
	return c, true, err
}

// take parses data, the file's content, and swaps it in if it is valid;
// s.mu is held.
func (s *Source) take(data []byte) (*Config, error) {
	s.seen = sha256.Sum256(data)
	c, err := parseFile(s.path, data, s.base)
	if err != nil {
		return nil, err
	}
	if c.Access.Enforced() != s.Current().Access.Enforced() {
		return nil, fmt.Errorf("config file %s: %w", s.path, access.ErrModeChange)
	}
	s.cur.Store(c)
	return c, nil
}
