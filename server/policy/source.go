package policy

import (
	"sync"
	"sync/atomic"
)

// Source is the set in force, read from a file and replaced by Reload. It
// is safe for concurrent use: Current never blocks and returns a whole set.
type Source struct {
	path string
	base Policy
	cur  atomic.Pointer[Set]
	// view, when set, gives the set in force in place of cur (View).
	view func() *Set
	mu   sync.Mutex // serialises reloads
}

// Open loads the policy file at path over base (see Parse) and returns the
// source holding it. An invalid file is an error.
func Open(path string, base Policy) (*Source, error) {
	set, err := Load(path, base)
	if err != nil {
		return nil, err
	}
	s := &Source{path: path, base: base}
	s.cur.Store(set)
	return s, nil
}

// Static returns a source that always holds set.
func Static(set *Set) *Source {
	s := &Source{}
	s.cur.Store(set)
	return s
}

// View returns a source whose set in force is what current returns: the
// policy part of a config file whose parts are replaced together
// (server/configfile). It has nothing to reload.
func View(current func() *Set) *Source { return &Source{view: current} }

// Path is the file the source reloads from; empty for a static source.
func (s *Source) Path() string { return s.path }

// Current returns the set in force.
func (s *Source) Current() *Set {
	if s.view != nil {
		return s.view()
	}
	return s.cur.Load()
}

// Reload reads the file again. When it is valid, its set replaces the one in
// force and is returned; otherwise the error says why and the set in force
// stays. A static source has nothing to reload and returns its set.
func (s *Source) Reload() (*Set, error) {
	if s.path == "" {
		return s.Current(), nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	set, err := Load(s.path, s.base)
	if err != nil {
		return nil, err
	}
	s.cur.Store(set)
	return set, nil
}
