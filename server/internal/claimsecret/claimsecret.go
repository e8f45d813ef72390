// Package claimsecret derives and checks claim secrets.
//
// A fencing token orders the holders of a key; it is not a credential. It
// comes from the store's clock (storage.NextToken), so it can be computed
// from the created_at or lease_expires_at that every Lookup and
// OUTCOME_IN_PROGRESS answer shows, and a completed record shows it
// outright. What proves a claim is its secret: the first ClaimSecretSize
// bytes of HMAC-SHA256 over (consumer, kind, key, token) under the store's
// claim key (storage.ClaimKeys). Only the answer that acquired the token
// carries it (and a repeat of that Claim with its request_id, which is as
// good as the answer itself); Complete, Release and Extend must send it
// back. Nothing is stored per record: every server on the store derives the
// same secret, and a secret is worthless once its token is not current,
// since tokens are never issued twice.
//
// The claim key has generations (storage.ClaimKeyRing), so that it can be
// rotated while servers run. A secret implies its generation rather than
// carrying it (its size is the API's): it is checked under every
// generation the server accepts, the current one first. A rotation adds a
// generation that is "next" until its activation, accepted but not issued
// under, so that every server knows it before any issues secrets under it;
// the generation it replaces stays accepted for the rotation's grace. Each
// server re-reads the keys every ClaimKeyRefresh, and at once, at most once
// per interval, when a secret verifies under none of the keys it knows.
package claimsecret

import (
	"bytes"
	"context"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/pagetoken"
	"github.com/idemreg/idemreg/storage"
)

// Size is the length of a claim secret.
const Size = 16

// DefaultRefresh is how often a server re-reads the claim keys by
// default: the bound on how late it learns of a rotation, which
// `idemreg rotate-claim-key`'s activation delay must exceed.
const DefaultRefresh = 30 * time.Second

// ErrUnknown: a claim secret verifies under no generation of the
// claim key the server accepts for the token it came with. It is not
// LEASE_LOST: nothing says another holder took over (a stale holder's own
// secret does verify, and the store then answers LEASE_LOST).
var ErrUnknown error = unknownError{}

type unknownError struct{}

func (unknownError) Error() string {
	return "claim_secret was not issued for this token under any claim key the registry accepts: not a secret of this registry, or one whose key generation was retired after a rotation's grace period"
}

// Reason is the reason it is answered with (server/internal/reason).
func (unknownError) Reason() idemregv1.ErrorReason {
	return idemregv1.ErrorReason_ERROR_REASON_CLAIM_SECRET_INVALID
}

// Secrets derives and checks claim secrets under the claim keys, read
// from the store on first use and again every refresh.
type Secrets struct {
	source  storage.ClaimKeys // nil: view is a key of this process only
	now     func() time.Time
	refresh time.Duration
	logger  *slog.Logger

	view     atomic.Pointer[keyView] // nil until read; then every call reads it without a lock
	mu       sync.Mutex              // serialises the reads of the store
	lastMiss atomic.Int64            // when a miss last caused a read, Unix ns by now
	lastWarn atomic.Int64            // when a miss was last logged, Unix ns by now
	unlogged atomic.Int64            // misses not logged since
}

// keyView is the claim keys as a server read them.
type keyView struct {
	keys   []Key     // newest first
	readAt time.Time // by Secrets.now
}

// Key is a generation of the claim key as a server read it, with the
// sealer of the page tokens issued under it.
type Key struct {
	storage.ClaimKey
	Sealer cipher.AEAD // page tokens' (pagetoken.Sealer)
}

// claimWarnEvery bounds the WARN lines about secrets that verify under no
// key to one per interval per server; the others are counted into it.
const claimWarnEvery = 10 * time.Second

// New reads the keys from keys, the store's; nil when the store
// keeps none, which gets a random key for this process only: secrets then
// survive neither a restart nor a move to another replica, so such a store
// suits a single process (tests).
func New(keys storage.ClaimKeys, now func() time.Time, refresh time.Duration, logger *slog.Logger) (c *Secrets, perProcess bool) {
	c = &Secrets{source: keys, now: now, refresh: refresh, logger: logger}
	if keys != nil {
		return c, false
	}
	key := make([]byte, storage.ClaimKeySize)
	_, _ = rand.Read(key) // never fails (crypto/rand)
	c.view.Store(newKeyView(storage.ClaimKeyRing{Keys: []storage.ClaimKey{{Generation: 1, Key: key}}}, time.Time{}))
	return c, true
}

func newKeyView(ring storage.ClaimKeyRing, readAt time.Time) *keyView {
	v := &keyView{readAt: readAt}
	for _, k := range ring.Keys {
		v.keys = append(v.keys, Key{ClaimKey: k, Sealer: pagetoken.Sealer(k.Key)})
	}
	return v
}

// load returns the keys, reading them when this server has none yet or
// they are older than the refresh interval. A failed re-read keeps the
// keys it has (and logs it); a failed first read is the store's error
// (storage.ErrUnavailable).
func (c *Secrets) load(ctx context.Context) (*keyView, error) {
	v := c.view.Load()
	if v == nil {
		c.mu.Lock()
		defer c.mu.Unlock()
		if v = c.view.Load(); v != nil {
			return v, nil
		}
		return c.read(ctx)
	}
	if c.source == nil || c.now().Sub(v.readAt) < c.refresh || !c.mu.TryLock() {
		return v, nil // another caller is reading them meanwhile
	}
	defer c.mu.Unlock()
	if nv := c.view.Load(); nv != v {
		return nv, nil
	}
	nv, err := c.read(ctx)
	if err != nil {
		c.logger.WarnContext(ctx, "claim keys: re-read failed; keeping the keys read before",
			"current_generation", v.current(c.now()).Generation, "error", err)
		return v, nil
	}
	return nv, nil
}

// read reads the keys from the store and logs when what it read differs
// from what the server had. The caller holds mu.
func (c *Secrets) read(ctx context.Context) (*keyView, error) {
	ring, err := c.source.ClaimKeyRing(ctx)
	if err != nil {
		return nil, err
	}
	now := c.now()
	nv := newKeyView(ring, now)
	old := c.view.Load()
	c.view.Store(nv)
	if old == nil || old.generations() != nv.generations() {
		attrs := []any{"current_generation", nv.current(now).Generation, "generations", nv.generations()}
		if next := nv.keys[0]; now.Before(next.ActiveFrom) {
			attrs = append(attrs, "next_generation", next.Generation, "next_active_from", next.ActiveFrom)
		}
		for _, k := range nv.keys {
			if !k.AcceptUntil.IsZero() {
				attrs = append(attrs, "previous_generation", k.Generation, "previous_accepted_until", k.AcceptUntil)
				break
			}
		}
		c.logger.InfoContext(ctx, "claim keys loaded", attrs...)
	}
	return nv, nil
}

// current is the generation to issue secrets under at now.
func (v *keyView) current(now time.Time) Key {
	for _, k := range v.keys {
		if !now.Before(k.ActiveFrom) && k.Accepted(now) {
			return k
		}
	}
	return v.keys[len(v.keys)-1]
}

// generations lists the generations, newest first ("3,2"): what a log
// line names, never a key.
func (v *keyView) generations() string {
	var b strings.Builder
	for i, k := range v.keys {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(k.Generation, 10))
	}
	return b.String()
}

// byGeneration is the key of gen when the server accepts it at now.
func (v *keyView) byGeneration(gen int64, now time.Time) (Key, bool) {
	for _, k := range v.keys {
		if k.Generation == gen && k.Accepted(now) {
			return k, true
		}
	}
	return Key{}, false
}

// Issuer is the key the server issues secrets and page tokens under now.
func (c *Secrets) Issuer(ctx context.Context) (Key, error) {
	v, err := c.load(ctx)
	if err != nil {
		return Key{}, err
	}
	return v.current(c.now()), nil
}

// Check answers nil when got is the secret of token for k under a
// generation the server accepts, ErrUnknown when it is not.
// Other errors: the store's (storage.ErrUnavailable) when the keys cannot
// be read.
func (c *Secrets) Check(ctx context.Context, k storage.Key, token int64, got []byte) error {
	v, err := c.load(ctx)
	if err != nil {
		return err
	}
	if v.verifies(k, token, got, c.now()) {
		return nil
	}
	if nv, ok := c.reread(ctx); ok {
		if nv.verifies(k, token, got, c.now()) {
			return nil
		}
		v = nv
	}
	c.warn(ctx, "claim secret verifies under no accepted claim key generation", v,
		"consumer", k.Consumer, "kind", idemregv1.Kind(k.Kind).String()) // k passed the request's validation
	return ErrUnknown
}

// reread reads the keys again after a miss (a rotation this server has
// not read yet?), at most once per refresh interval, so that forged
// secrets and tokens cannot drive the reads; false when it did not.
func (c *Secrets) reread(ctx context.Context) (*keyView, bool) {
	now := c.now().UnixNano()
	last := c.lastMiss.Load()
	if c.source == nil || now-last < int64(c.refresh) || !c.lastMiss.CompareAndSwap(last, now) {
		return nil, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	nv, err := c.read(ctx)
	if err != nil {
		c.logger.WarnContext(ctx, "claim keys: re-read failed", "error", err)
		return nil, false
	}
	return nv, true
}

// Sealer is the page tokens' key of generation gen, nil when the server
// accepts no such generation, also after re-reading the keys (at most once
// per interval, as for a secret). Errors: the store's when the keys cannot
// be read at all.
func (c *Secrets) Sealer(ctx context.Context, gen int64) (cipher.AEAD, error) {
	v, err := c.load(ctx)
	if err != nil {
		return nil, err
	}
	if k, ok := v.byGeneration(gen, c.now()); ok {
		return k.Sealer, nil
	}
	if nv, ok := c.reread(ctx); ok {
		if k, ok := nv.byGeneration(gen, c.now()); ok {
			return k.Sealer, nil
		}
		v = nv
	}
	c.warn(ctx, "page token sealed under a claim key generation not accepted", v, "generation", gen)
	return nil, nil
}

// Generation is the key of generation gen, false when the server
// accepts no such generation, also after re-reading the keys (at most once
// per interval, as for a secret). Errors: the store's when the keys cannot
// be read at all.
func (c *Secrets) Generation(ctx context.Context, gen int64) (Key, bool, error) {
	v, err := c.load(ctx)
	if err != nil {
		return Key{}, false, err
	}
	if k, ok := v.byGeneration(gen, c.now()); ok {
		return k, true, nil
	}
	if nv, ok := c.reread(ctx); ok {
		if k, ok := nv.byGeneration(gen, c.now()); ok {
			return k, true, nil
		}
	}
	return Key{}, false, nil
}

func (v *keyView) verifies(k storage.Key, token int64, got []byte, now time.Time) bool {
	for _, key := range v.keys {
		if key.Accepted(now) && equal(key.Key, k, token, got) {
			return true
		}
	}
	return false
}

// warn logs a secret or page token that verified under no key the
// server accepts, at most once per claimWarnEvery, with how many were not
// logged since: what a caller sends must not drive the log.
func (c *Secrets) warn(ctx context.Context, msg string, v *keyView, attrs ...any) {
	now := c.now().UnixNano()
	last := c.lastWarn.Load()
	if now-last < int64(claimWarnEvery) || !c.lastWarn.CompareAndSwap(last, now) {
		c.unlogged.Add(1)
		return
	}
	attrs = append(attrs, "current_generation", v.current(c.now()).Generation,
		"accepted_generations", v.generations(), "not_logged_since", c.unlogged.Swap(0))
	c.logger.WarnContext(ctx, msg, attrs...)
}

// Derive is the claim secret of token for k under key (a claim key).
func Derive(key []byte, k storage.Key, token int64) []byte {
	m := getMAC(key)
	out := append(make([]byte, 0, Size), m.sum(k, token)...)
	macs.Put(m)
	return out
}

// equal says whether got is the claim secret of token for k under key,
// without the allocation of Derive's answer.
func equal(key []byte, k storage.Key, token int64, got []byte) bool {
	m := getMAC(key)
	ok := hmac.Equal(m.sum(k, token), got)
	macs.Put(m)
	return ok
}

// macs holds keyed HMACs between calls: a new one costs two SHA-256
// states, the keyed pads and their copies, about ten allocations, on
// every Claim and Complete of every batch item (issue 36). One claim key
// signs nearly every call, so a pooled HMAC is nearly always keyed with
// the key asked for; one keyed otherwise is rebuilt.
var macs sync.Pool

// mac is a pooled HMAC-SHA-256 keyed with key, and its scratch space.
type mac struct {
	key []byte
	h   hash.Hash
	msg []byte
	out [sha256.Size]byte
}

func getMAC(key []byte) *mac {
	m, _ := macs.Get().(*mac)
	if m == nil || !bytes.Equal(m.key, key) {
		return &mac{key: bytes.Clone(key), h: hmac.New(sha256.New, key), msg: make([]byte, 0, 128)}
	}
	m.h.Reset()
	return m
}

// sum is the claim secret of token for k, in m's scratch space: valid
// until m is used again.
func (m *mac) sum(k storage.Key, token int64) []byte {
	// Length-prefixed fields: no two keys encode alike.
	b := append(m.msg[:0], "idemreg claim secret v1"...)
	b = binary.AppendUvarint(b, uint64(len(k.Consumer)))
	b = append(b, k.Consumer...)
	b = append(b, byte(k.Kind))
	b = binary.AppendUvarint(b, uint64(len(k.Key)))
	b = append(b, k.Key...)
	b = binary.BigEndian.AppendUint64(b, uint64(token))
	m.msg = b
	m.h.Write(b)
	return m.h.Sum(m.out[:0])[:Size]
}
