package server

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"strings"
	"time"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/storage"
)

// Page tokens of ListRecords.
//
// A page token carries where the next page starts (the key after which it
// reads, storage.ListParams.After) and a digest of the filters of the
// listing that issued it:
//
//	base64url(version (2) | key generation (8) | filter digest (8) | nonce (12) | sealed key)
//
// The digest makes a token sent with other filters INVALID_ARGUMENT
// (AIP-158) rather than a listing that silently skips what the new filters
// would have shown before the token's key. The key is sealed (AES-256-GCM,
// the head as additional data) because it is not always the caller's to
// read: a listing by prefix drops the records of consumers the identity
// may not administer, and the page may stop at one of them. The sealing
// key is derived from a generation of the store's claim key
// (claimSecrets), named in the token, so every replica on the store opens
// the tokens of the others, also across a rotation while the generation is
// accepted; on a store without one, tokens are good in the process that
// issued them only. The seal also makes a token that was tampered with
// INVALID_ARGUMENT. Version 1 tokens, from before key generations, have no
// generation field and were sealed under generation 1.

const (
	pageTokenVersion   = 2
	pageTokenVersionV1 = 1
	// digestVersion is hashed into the filter digest; it stayed 1 when the
	// token gained its generation, so that the digest of a version 1
	// token still matches.
	digestVersion = 1
)

// MaxPageTokenBytes bounds a page_token before it is decoded: a token of a
// valid key is well under it.
const MaxPageTokenBytes = 1024

// listFilters is the digest of a listing's filters; page_size is not part
// of it, since a caller may change it from page to page (AIP-158).
type listFilters [8]byte

func digestFilters(p storage.ListParams) listFilters {
	b := []byte{digestVersion}
	b = binary.AppendUvarint(b, uint64(len(p.Consumer)))
	b = append(b, p.Consumer...)
	if p.Prefix {
		b = append(b, 1)
	} else {
		b = append(b, 0)
	}
	b = binary.AppendUvarint(b, uint64(p.State))
	b = binary.AppendVarint(b, p.MinAttempt)
	b = binary.AppendVarint(b, int64(p.OlderThan))
	sum := sha256.Sum256(b)
	return listFilters(sum[:8])
}

// pageSealer seals and opens page tokens under a key derived from the
// store's claim key, kept apart from the claim secrets by its label.
func pageSealer(claimKey []byte) cipher.AEAD {
	m := hmac.New(sha256.New, claimKey)
	m.Write([]byte("idemreg page token v1"))
	block, err := aes.NewCipher(m.Sum(nil))
	if err != nil {
		panic(err) // a 32-byte key is always a valid AES key
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		panic(err) // AES has GCM's block size
	}
	return aead
}

func encodePageToken(key viewKey, f listFilters, after storage.Key) string {
	head := binary.BigEndian.AppendUint64([]byte{pageTokenVersion}, uint64(key.Generation))
	head = append(head, f[:]...)
	aead := key.sealer
	nonce := make([]byte, aead.NonceSize())
	_, _ = rand.Read(nonce) // never fails (crypto/rand)
	plain := []byte{byte(after.Kind)}
	plain = binary.AppendUvarint(plain, uint64(len(after.Consumer)))
	plain = append(plain, after.Consumer...)
	plain = binary.AppendUvarint(plain, uint64(len(after.Key)))
	plain = append(plain, after.Key...)
	out := append(append([]byte{}, head...), nonce...)
	return base64.RawURLEncoding.EncodeToString(aead.Seal(out, nonce, plain, head))
}

// pageTokenGeneration is the claim key generation token was sealed under,
// false when it is not a page token at all.
func pageTokenGeneration(token string) (int64, bool) {
	b, err := base64.RawURLEncoding.DecodeString(token)
	switch {
	case err != nil || len(b) < 1:
		return 0, false
	case b[0] == pageTokenVersionV1:
		return 1, true
	case b[0] == pageTokenVersion && len(b) >= 9:
		return int64(binary.BigEndian.Uint64(b[1:9])), true
	}
	return 0, false
}

// pageTokenGarbled is the violation of a page_token that is not one.
const pageTokenGarbled = "not a page token of ListRecords: send the next_page_token of the previous page unchanged, or none for the first page"

// pageToken returns where the page of token starts, adding a violation of
// page_token when it is not a token of the listing p (digest f) sealed by
// aead.
func (v *violations) pageToken(aead cipher.AEAD, token string, f listFilters, p storage.ListParams) *storage.Key {
	b, err := base64.RawURLEncoding.DecodeString(token)
	if err != nil || len(b) < 1 {
		v.add("page_token", pageTokenGarbled)
		return nil
	}
	digestAt := 1
	if b[0] == pageTokenVersion {
		digestAt = 9
	}
	head := digestAt + len(f)
	if len(b) < head+aead.NonceSize() || (b[0] != pageTokenVersion && b[0] != pageTokenVersionV1) {
		v.add("page_token", pageTokenGarbled)
		return nil
	}
	if !bytes.Equal(b[digestAt:head], f[:]) {
		v.add("page_token", "was issued for other filters: send the filters of the first page (consumer, consumer_prefix, state, min_attempt, older_than) with each of its page tokens")
		return nil
	}
	plain, err := aead.Open(nil, b[head:head+aead.NonceSize()], b[head+aead.NonceSize():], b[:head])
	if err != nil || len(plain) < 1 {
		v.add("page_token", pageTokenGarbled)
		return nil
	}
	k := storage.Key{Kind: storage.Kind(plain[0])}
	plain = plain[1:]
	field := func() (string, bool) {
		n, used := binary.Uvarint(plain)
		if used <= 0 || n > uint64(len(plain)-used) {
			return "", false
		}
		s := string(plain[used : used+int(n)])
		plain = plain[used+int(n):]
		return s, true
	}
	var okC, okK bool
	k.Consumer, okC = field()
	k.Key, okK = field()
	// Sealed by a server, so well formed and in range; checked anyway, so
	// that no token reaches the store with a start outside its filters.
	inRange := k.Consumer == p.Consumer || p.Prefix && strings.HasPrefix(k.Consumer, p.Consumer)
	if !okC || !okK || len(plain) != 0 || k.Key == "" || !inRange ||
		(k.Kind != storage.KindMessage && k.Kind != storage.KindOperation) {
		v.add("page_token", pageTokenGarbled)
		return nil
	}
	return &k
}

// validateList checks a ListRecords request and returns the store's
// parameters and the digest of its filters. The page token is opened
// after (ListRecords), under the store's key, and only for valid filters,
// since it is checked against them.
func validateList(r *idemregv1.ListRecordsRequest) (storage.ListParams, listFilters, error) {
	var v violations
	p := storage.ListParams{Consumer: r.GetConsumer(), Prefix: r.GetConsumerPrefix(), State: storage.State(r.GetState()),
		MinAttempt: r.GetMinAttempt()}
	switch {
	case p.Prefix:
		v.consumerPrefix("consumer", p.Consumer) // empty: every consumer
	case p.Consumer == "":
		v.add("consumer", "required: the consumer to list, or set consumer_prefix to list every consumer whose name starts with consumer")
	default:
		v.consumerPrefix("consumer", p.Consumer)
	}
	if _, ok := idemregv1.State_name[int32(r.GetState())]; !ok {
		v.add("state", "must be a State (STATE_UNSPECIFIED for any), got %d", r.GetState())
	}
	if p.MinAttempt < 0 {
		v.add("min_attempt", "must not be negative (0: any), got %d", p.MinAttempt)
	}
	if d := r.GetOlderThan(); d != nil {
		switch err := d.CheckValid(); {
		case err != nil:
			v.add("older_than", "invalid duration: %v", err)
		case d.AsDuration() < 0:
			v.add("older_than", "must not be negative, got %v", d.AsDuration())
		case d.AsDuration() > MaxListOlderThan:
			v.add("older_than", "must be at most %v, got %v", MaxListOlderThan, d.AsDuration())
		default:
			// Stores keep microseconds; both backends must see the same value.
			p.OlderThan = d.AsDuration().Truncate(time.Microsecond)
		}
	}
	switch n := r.GetPageSize(); {
	case n == 0:
		p.Limit = DefaultListPageSize
	case n < 0 || n > MaxListPageSize:
		v.add("page_size", "must be between 1 and %d, or 0 for %d, got %d", MaxListPageSize, DefaultListPageSize, n)
	default:
		p.Limit = int(n)
	}
	if n := len(r.GetPageToken()); n > MaxPageTokenBytes {
		v.add("page_token", "must be at most %d bytes, got %d", MaxPageTokenBytes, n)
	}
	return p, digestFilters(p), v.err()
}
