package access

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Limit is the rate limit of each consumer (or each identity) a rule
// matches: every consumer, and every identity, has a bucket of its own.
type Limit struct {
	// Rate is the sustained number of requests per second.
	Rate float64
	// Burst is how many requests may come at once after a quiet spell.
	Burst int
	// Pattern is the rule's pattern, for messages: "orders.*".
	Pattern string
	// Of is "identities" for a rule of identities, empty for consumers.
	Of string
	// Default is set on DefaultIdentityLimit, which no rule wrote.
	Default bool
	// Replicas is how many live replicas share the limit: a Limit of the
	// config file is the service's, and each replica's bucket takes
	// 1/Replicas of it (Share). Zero or one: the whole limit.
	Replicas int
}

// Share is l as one of n live replicas applies it: each replica's bucket
// fills at Rate/n and holds Burst/n (rounded up, at least 1), so that a
// caller spreading its calls over the replicas gets the service's rate,
// and one that sends every call to one replica gets 1/n of it. n below 2
// leaves l whole.
func (l Limit) Share(n int) Limit {
	if n < 2 {
		n = 0
	}
	l.Replicas = n
	return l
}

// bucket is the rate and burst of this replica's bucket under l.
func (l Limit) bucket() (rate.Limit, int) {
	n := max(l.Replicas, 1)
	return rate.Limit(l.Rate / float64(n)), max(1, (l.Burst+n-1)/n)
}

// String describes l for an error message.
func (l Limit) String() string {
	rate := strconv.FormatFloat(l.Rate, 'f', -1, 64)
	if l.Default {
		return fmt.Sprintf("%s requests per second, burst %d (the default of each identity; a rate_limits rule of identities replaces it)%s", rate, l.Burst, l.shared())
	}
	of := ""
	if l.Of != "" {
		of = l.Of + " "
	}
	return fmt.Sprintf("%s requests per second, burst %d (rate_limits %s%q)%s", rate, l.Burst, of, l.Pattern, l.shared())
}

// shared says how a limit shared by replicas is split, for String.
func (l Limit) shared() string {
	if l.Replicas < 2 {
		return ""
	}
	r, b := l.bucket()
	return fmt.Sprintf("; one of %d live replicas, this one allows %s per second, burst %d",
		l.Replicas, strconv.FormatFloat(float64(r), 'g', 4, 64), b)
}

// DefaultIdentityLimit is the rate limit of each identity of a Set that
// names identities but has no rule of identities: a tenant's calls are
// bounded even where the operator wrote no rule, so that one tenant's
// runaway loop, or its flood, cannot take a replica's whole capacity from
// the others. It is the rule deploy/base/policy-configmap.yaml
// ships, well above what one tenant of a shared replica should need, and a
// rule of identities ("*", or a name) replaces it. A Set without
// identities (every caller Anonymous) has none: there is no other tenant.
var DefaultIdentityLimit = Limit{Rate: 2000, Burst: 4000, Pattern: "*", Of: "identities", Default: true}

// identityRules are the rate limits of identities: by name, else "*".
type identityRules struct {
	names map[string]Limit
	all   *Limit
}

func (r *identityRules) add(name string, l Limit) error {
	l.Pattern = name
	if name == "*" {
		if r.all != nil {
			return fmt.Errorf("%q is given twice", name)
		}
		r.all = &l
		return nil
	}
	if r.names == nil {
		r.names = map[string]Limit{}
	}
	if _, dup := r.names[name]; dup {
		return fmt.Errorf("%q is given twice", name)
	}
	r.names[name] = l
	return nil
}

// IdentityRateLimit returns the limit of the calls of the identity named
// name, whatever their consumers: the rule naming it, else the "*" rule of
// identities, else, when the Set names identities, DefaultIdentityLimit.
// ok is false when none applies.
func (s *Set) IdentityRateLimit(name string) (l Limit, ok bool) {
	if l, ok := s.identityLimits.names[name]; ok {
		return l, true
	}
	if s.identityLimits.all != nil {
		return *s.identityLimits.all, true
	}
	if s.Enforced() {
		return DefaultIdentityLimit, true
	}
	return Limit{}, false
}

type limitRules struct {
	names    map[string]Limit
	prefixes []prefixLimit // longest first
	all      *Limit
}

type prefixLimit struct {
	prefix string
	limit  Limit
}

// RateLimit returns the limit of consumer: the rule naming it, else the
// rule of its longest matching prefix, else the "*" rule. ok is false when
// no rule applies: the consumer is not limited.
func (s *Set) RateLimit(consumer string) (l Limit, ok bool) {
	r := &s.limits
	if l, ok := r.names[consumer]; ok {
		return l, true
	}
	for _, p := range r.prefixes {
		if strings.HasPrefix(consumer, p.prefix) {
			return p.limit, true
		}
	}
	if r.all != nil {
		return *r.all, true
	}
	return Limit{}, false
}

func (r *limitRules) add(pattern string, l Limit) error {
	if r.names == nil {
		r.names = map[string]Limit{}
	}
	l.Pattern = pattern
	switch {
	case pattern == "*":
		if r.all != nil {
			return fmt.Errorf("%q is given twice", pattern)
		}
		r.all = &l
	case strings.HasSuffix(pattern, "*"):
		pre := strings.TrimSuffix(pattern, "*")
		if err := checkConsumer(pre); err != nil {
			return err
		}
		for _, p := range r.prefixes {
			if p.prefix == pre {
				return fmt.Errorf("%q is given twice", pattern)
			}
		}
		r.prefixes = append(r.prefixes, prefixLimit{prefix: pre, limit: l})
		slices.SortFunc(r.prefixes, func(a, b prefixLimit) int {
			if c := cmp.Compare(len(b.prefix), len(a.prefix)); c != 0 {
				return c
			}
			return strings.Compare(a.prefix, b.prefix)
		})
	default:
		if err := checkConsumer(pattern); err != nil {
			return err
		}
		if pattern == "" {
			return fmt.Errorf("empty pattern")
		}
		if _, dup := r.names[pattern]; dup {
			return fmt.Errorf("%q is given twice", pattern)
		}
		r.names[pattern] = l
	}
	return nil
}

// Limiter keeps a token bucket per key (a consumer, an identity). It is
// safe for concurrent use.
//
// A bucket left alone for as long as it takes to refill is full, exactly as
// a new one would be, so such buckets are dropped: memory follows the
// consumers active lately, not every consumer ever seen.
type Limiter struct {
	now func() time.Time

	mu        sync.Mutex
	buckets   map[string]*bucket
	lastPrune time.Time
}

type bucket struct {
	lim   *rate.Limiter
	limit Limit
	last  time.Time
}

// pruneEvery is how often idle buckets are looked for.
const pruneEvery = time.Minute

// NewLimiter returns a Limiter on the clock now (time.Now when nil).
func NewLimiter(now func() time.Time) *Limiter {
	if now == nil {
		now = time.Now
	}
	return &Limiter{now: now, buckets: map[string]*bucket{}}
}

// Allow takes one request of the bucket key under limit l. When the request
// is refused, wait is how long until one would be allowed. A changed limit
// (a reload) applies to the bucket from now on.
func (lim *Limiter) Allow(key string, l Limit) (ok bool, wait time.Duration) {
	return lim.AllowN(key, l, 1)
}

// AllowN is Allow for a request that costs n tokens; one that costs more
// than the burst is never allowed.
func (lim *Limiter) AllowN(key string, l Limit, n int) (ok bool, wait time.Duration) {
	now := lim.now()
	lim.mu.Lock()
	b := lim.buckets[key]
	switch {
	case b == nil:
		r, burst := l.bucket()
		b = &bucket{lim: rate.NewLimiter(r, burst), limit: l}
		lim.buckets[key] = b
	case b.limit != l:
		r, burst := l.bucket()
		b.lim.SetLimitAt(now, r)
		b.lim.SetBurstAt(now, burst)
		b.limit = l
	}
	b.last = now
	if now.Sub(lim.lastPrune) >= pruneEvery {
		lim.prune(now)
	}
	lim.mu.Unlock()

	r := b.lim.ReserveN(now, n)
	if !r.OK() {
		return false, time.Second
	}
	if d := r.DelayFrom(now); d > 0 {
		r.CancelAt(now)
		return false, d
	}
	return true, 0
}

// prune drops the buckets idle long enough to have refilled. lim.mu is held.
func (lim *Limiter) prune(now time.Time) {
	lim.lastPrune = now
	for c, b := range lim.buckets {
		r, burst := b.limit.bucket()
		refill := time.Duration(math.Ceil(float64(burst) / float64(r) * float64(time.Second)))
		if now.Sub(b.last) > refill {
			delete(lim.buckets, c)
		}
	}
}

// Len returns the number of buckets held, for tests and metrics.
func (lim *Limiter) Len() int {
	lim.mu.Lock()
	defer lim.mu.Unlock()
	return len(lim.buckets)
}
