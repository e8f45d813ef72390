// Package pagetoken makes and opens the page tokens of ListRecords.
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
// key is derived from a generation of the store's claim key (the server's
// claim secrets), named in the token, so every replica on the store opens
// the tokens of the others, also across a rotation while the generation is
// accepted; on a store without one, tokens are good in the process that
// issued them only. The seal also makes a token that was tampered with
// INVALID_ARGUMENT. Version 1 tokens, from before key generations, have no
// generation field and were sealed under generation 1.
package pagetoken

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"strings"

	"github.com/idemreg/idemreg/storage"
)

const (
	version   = 2
	versionV1 = 1
	// digestVersion is hashed into the filter digest; it stayed 1 when the
	// token gained its generation, so that the digest of a version 1
	// token still matches.
	digestVersion = 1
)

// encoding is strict: a token has one spelling. The last character of
// unpadded base64 carries bits that a lenient decoder drops, so without
// Strict a token with that character changed would still open.
var encoding = base64.RawURLEncoding.Strict()

// MaxBytes bounds a page_token before it is decoded: a token of a valid
// key is well under it.
const MaxBytes = 1024

// Open's errors; their text is what the caller reads in the BadRequest of
// its page_token.
var (
	// ErrGarbled: not a token, tampered with, or not of these filters' range.
	ErrGarbled = errors.New("not a page token of ListRecords: send the next_page_token of the previous page unchanged, or none for the first page")
	// ErrOtherFilters: a token of a listing with other filters.
	ErrOtherFilters = errors.New("was issued for other filters: send the filters of the first page (consumer, consumer_prefix, state, min_attempt, older_than) with each of its page tokens")
)

// Filters is the digest of a listing's filters; page_size is not part of
// it, since a caller may change it from page to page (AIP-158).
type Filters [8]byte

// Digest is the digest of p's filters.
func Digest(p storage.ListParams) Filters {
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
	return Filters(sum[:8])
}

// Sealer seals and opens page tokens under a key derived from a claim key,
// kept apart from the claim secrets by its label.
func Sealer(claimKey []byte) cipher.AEAD {
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

// Encode is the token of the page after the key after, of a listing with
// filters f, sealed by aead (Sealer of the claim key of generation).
func Encode(aead cipher.AEAD, generation int64, f Filters, after storage.Key) string {
	head := binary.BigEndian.AppendUint64([]byte{version}, uint64(generation))
	head = append(head, f[:]...)
	nonce := make([]byte, aead.NonceSize())
	_, _ = rand.Read(nonce) // never fails (crypto/rand)
	plain := []byte{byte(after.Kind)}
	plain = binary.AppendUvarint(plain, uint64(len(after.Consumer)))
	plain = append(plain, after.Consumer...)
	plain = binary.AppendUvarint(plain, uint64(len(after.Key)))
	plain = append(plain, after.Key...)
	out := append(append([]byte{}, head...), nonce...)
	return encoding.EncodeToString(aead.Seal(out, nonce, plain, head))
}

// Generation is the claim key generation token was sealed under, false
// when it is not a page token at all.
func Generation(token string) (int64, bool) {
	b, err := encoding.DecodeString(token)
	switch {
	case err != nil || len(b) < 1:
		return 0, false
	case b[0] == versionV1:
		return 1, true
	case b[0] == version && len(b) >= 9:
		return int64(binary.BigEndian.Uint64(b[1:9])), true
	}
	return 0, false
}

// Open returns where the page of token starts: ErrOtherFilters when it is
// a token of a listing with other filters than f, ErrGarbled when it is
// not a token of the listing p sealed by aead.
func Open(aead cipher.AEAD, token string, f Filters, p storage.ListParams) (storage.Key, error) {
	b, err := encoding.DecodeString(token)
	if err != nil || len(b) < 1 {
		return storage.Key{}, ErrGarbled
	}
	digestAt := 1
	if b[0] == version {
		digestAt = 9
	}
	head := digestAt + len(f)
	if len(b) < head+aead.NonceSize() || (b[0] != version && b[0] != versionV1) {
		return storage.Key{}, ErrGarbled
	}
	if !bytes.Equal(b[digestAt:head], f[:]) {
		return storage.Key{}, ErrOtherFilters
	}
	plain, err := aead.Open(nil, b[head:head+aead.NonceSize()], b[head+aead.NonceSize():], b[:head])
	if err != nil || len(plain) < 1 {
		return storage.Key{}, ErrGarbled
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
		return storage.Key{}, ErrGarbled
	}
	return k, nil
}
