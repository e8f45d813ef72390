package pebble

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// Key space. The first byte of every key says what it is, so the three
// families never interleave and each can be walked on its own.
const (
	prefixMeta   byte = 0x00
	prefixRecord byte = 0x01
	prefixExpiry byte = 0x02
)

var (
	// metaFormat holds the layout version of the data directory.
	metaFormat = []byte{prefixMeta, 'f', 'o', 'r', 'm', 'a', 't'}
	// metaTokenFloor holds the greatest token of any record the sweeper
	// deleted: the token a deleted key's next claim must exceed.
	metaTokenFloor = []byte{prefixMeta, 't', 'o', 'k', 'e', 'n', '-', 'f', 'l', 'o', 'o', 'r'}
	// metaClaimKey holds the claim key (storage.ClaimKeys).
	metaClaimKey = []byte{prefixMeta, 'c', 'l', 'a', 'i', 'm', '-', 'k', 'e', 'y'}
)

// layoutVersion is the version of the key layout and of metaFormat.
const layoutVersion byte = 1

// A record key is prefixRecord, the escaped consumer, a terminator, the kind
// byte and the key's bytes as they are. Escaping 0x00 as 0x00 0xFF and
// terminating with 0x00 0x01 keeps the encoding unambiguous and ordered like
// (consumer, kind, key): a consumer that is a prefix of another sorts first,
// because its terminator is below any escaped or plain byte. The key needs no
// escaping since nothing follows it.
const (
	escByte  = 0x00
	escZero  = 0xFF
	escTerm  = 0x01
	timeBias = uint64(1) << 63
)

func appendRecordKey(dst []byte, k storage.Key) []byte {
	dst = append(dst, prefixRecord)
	for i := 0; i < len(k.Consumer); i++ {
		c := k.Consumer[i]
		if c == escByte {
			dst = append(dst, escByte, escZero)
			continue
		}
		dst = append(dst, c)
	}
	dst = append(dst, escByte, escTerm, byte(k.Kind))
	return append(dst, k.Key...)
}

var errBadKey = errors.New("pebble: malformed record key")

func decodeRecordKey(b []byte) (storage.Key, error) {
	if len(b) == 0 || b[0] != prefixRecord {
		return storage.Key{}, errBadKey
	}
	b = b[1:]
	consumer := make([]byte, 0, len(b))
	for i := 0; ; i++ {
		if i >= len(b) {
			return storage.Key{}, errBadKey
		}
		if b[i] != escByte {
			consumer = append(consumer, b[i])
			continue
		}
		if i+1 >= len(b) {
			return storage.Key{}, errBadKey
		}
		switch b[i+1] {
		case escZero:
			consumer = append(consumer, escByte)
			i++
		case escTerm:
			if i+2 >= len(b) {
				return storage.Key{}, errBadKey
			}
			return storage.Key{Consumer: string(consumer), Kind: storage.Kind(b[i+2]), Key: string(b[i+3:])}, nil
		default:
			return storage.Key{}, errBadKey
		}
	}
}

// An expiry index key is prefixExpiry, expires_at in microseconds as a
// biased big-endian uint64 (so byte order is time order, before 1970 too),
// then the record key. Its value is empty.
const expiryHeader = 1 + 8

func appendExpiryKey(dst []byte, expiresAt time.Time, recordKey []byte) []byte {
	dst = appendExpiryBound(dst, expiresAt.UnixMicro())
	return append(dst, recordKey...)
}

// appendExpiryBound appends the index prefix of every entry expiring at µs.
func appendExpiryBound(dst []byte, micros int64) []byte {
	dst = append(dst, prefixExpiry)
	return binary.BigEndian.AppendUint64(dst, uint64(micros)^timeBias)
}

func decodeExpiryKey(b []byte) (expiresAt time.Time, recordKey []byte, err error) {
	if len(b) <= expiryHeader || b[0] != prefixExpiry {
		return time.Time{}, nil, fmt.Errorf("pebble: malformed expiry key %x", b)
	}
	micros := int64(binary.BigEndian.Uint64(b[1:expiryHeader]) ^ timeBias)
	return time.UnixMicro(micros).UTC(), b[expiryHeader:], nil
}

// A record value, version 1:
//
//	version (1) | state | flags | token varint | attempt uvarint
//	| created_at varint µs | lease_expires_at varint µs
//	| completed_at varint µs, when flagCompletedAt | expires_at varint µs
//	| retention varint µs | fingerprint uvarint length + bytes
//	| holder uvarint length + bytes | result: the rest of the value
//
// Version 2 is version 1 with, after the holder, the request id (uvarint
// length + bytes) and the lease (varint µs). It is written for every record
// that has either, which is every record a Claim writes from this version
// on: a binary that knows only version 1 then fails loudly on a version it
// does not know instead of reading them as part of the result. Version 1
// values, written before, still decode (no request id, no lease).
//
// Version 3 is version 2 with, after the lease, the park reason (uvarint
// length + bytes). It is written only for a record that has one, a parked
// record, so every other record keeps the layout older binaries read, and
// an older binary fails loudly on a parked record instead of reading the
// reason as part of the result.
//
// The key is not repeated: it is the record key.
const (
	valueVersion1   byte = 1
	valueVersion2   byte = 2
	valueVersion3   byte = 3
	flagCompletedAt byte = 1 << 0
)

func varintLen(v int64) int {
	var b [binary.MaxVarintLen64]byte
	return binary.PutVarint(b[:], v)
}

func uvarintLen(v uint64) int {
	var b [binary.MaxVarintLen64]byte
	return binary.PutUvarint(b[:], v)
}

// recordSize is the exact length appendRecord appends for r.
func recordSize(r *storage.Record) int {
	n := 3 +
		varintLen(r.Token) +
		uvarintLen(uint64(r.Attempt)) +
		varintLen(r.CreatedAt.UnixMicro()) +
		varintLen(r.LeaseExpiresAt.UnixMicro()) +
		varintLen(r.ExpiresAt.UnixMicro()) +
		varintLen(r.Retention.Microseconds()) +
		uvarintLen(uint64(len(r.Fingerprint))) + len(r.Fingerprint) +
		uvarintLen(uint64(len(r.Holder))) + len(r.Holder) +
		len(r.Result)
	if !r.CompletedAt.IsZero() {
		n += varintLen(r.CompletedAt.UnixMicro())
	}
	if valueVersion(r) >= valueVersion2 {
		n += uvarintLen(uint64(len(r.RequestID))) + len(r.RequestID) + varintLen(r.Lease.Microseconds())
	}
	if valueVersion(r) == valueVersion3 {
		n += uvarintLen(uint64(len(r.ParkReason))) + len(r.ParkReason)
	}
	return n
}

// valueVersion is the layout appendRecord uses for r.
func valueVersion(r *storage.Record) byte {
	if r.ParkReason != "" {
		return valueVersion3
	}
	if r.RequestID != "" || r.Lease != 0 {
		return valueVersion2
	}
	return valueVersion1
}

func appendRecord(dst []byte, r *storage.Record) []byte {
	var flags byte
	if !r.CompletedAt.IsZero() {
		flags |= flagCompletedAt
	}
	version := valueVersion(r)
	dst = append(dst, version, byte(r.State), flags)
	dst = binary.AppendVarint(dst, r.Token)
	dst = binary.AppendUvarint(dst, uint64(r.Attempt))
	dst = binary.AppendVarint(dst, r.CreatedAt.UnixMicro())
	dst = binary.AppendVarint(dst, r.LeaseExpiresAt.UnixMicro())
	if flags&flagCompletedAt != 0 {
		dst = binary.AppendVarint(dst, r.CompletedAt.UnixMicro())
	}
	dst = binary.AppendVarint(dst, r.ExpiresAt.UnixMicro())
	dst = binary.AppendVarint(dst, r.Retention.Microseconds())
	dst = binary.AppendUvarint(dst, uint64(len(r.Fingerprint)))
	dst = append(dst, r.Fingerprint...)
	dst = binary.AppendUvarint(dst, uint64(len(r.Holder)))
	dst = append(dst, r.Holder...)
	if version >= valueVersion2 {
		dst = binary.AppendUvarint(dst, uint64(len(r.RequestID)))
		dst = append(dst, r.RequestID...)
		dst = binary.AppendVarint(dst, r.Lease.Microseconds())
	}
	if version == valueVersion3 {
		dst = binary.AppendUvarint(dst, uint64(len(r.ParkReason)))
		dst = append(dst, r.ParkReason...)
	}
	return append(dst, r.Result...)
}

var errBadValue = errors.New("pebble: malformed record value")

// valueReader reads a value front to back; the first failure sticks.
type valueReader struct {
	b   []byte
	bad bool
}

func (v *valueReader) varint() int64 {
	x, n := binary.Varint(v.b)
	if n <= 0 {
		v.bad = true
		return 0
	}
	v.b = v.b[n:]
	return x
}

func (v *valueReader) bytes() []byte {
	l, n := binary.Uvarint(v.b)
	if n <= 0 || l > uint64(len(v.b)-n) {
		v.bad = true
		return nil
	}
	out := v.b[n : n+int(l)]
	v.b = v.b[n+int(l):]
	return out
}

func (v *valueReader) time() time.Time { return time.UnixMicro(v.varint()).UTC() }

// decodeRecord fills r (whose Key the caller sets) from a value. It copies
// what it keeps, so b may be released afterwards.
func decodeRecord(b []byte, r *storage.Record) error {
	if len(b) < 3 {
		return errBadValue
	}
	version := b[0]
	if version < valueVersion1 || version > valueVersion3 {
		return fmt.Errorf("pebble: unknown record value version %d", b[0])
	}
	r.State = storage.State(b[1])
	flags := b[2]
	v := valueReader{b: b[3:]}
	r.Token = v.varint()
	attempt, n := binary.Uvarint(v.b)
	if n <= 0 {
		return errBadValue
	}
	v.b = v.b[n:]
	r.Attempt = int64(attempt)
	r.CreatedAt = v.time()
	r.LeaseExpiresAt = v.time()
	r.CompletedAt = time.Time{}
	if flags&flagCompletedAt != 0 {
		r.CompletedAt = v.time()
	}
	r.ExpiresAt = v.time()
	r.Retention = time.Duration(v.varint()) * time.Microsecond
	fp := v.bytes()
	holder := v.bytes()
	var (
		requestID  []byte
		lease      int64
		parkReason []byte
	)
	if version >= valueVersion2 {
		requestID = v.bytes()
		lease = v.varint()
	}
	if version == valueVersion3 {
		parkReason = v.bytes()
	}
	if v.bad {
		return errBadValue
	}
	// One allocation for both byte fields; the holder becomes a string.
	r.Fingerprint, r.Result = nil, nil
	if len(fp)+len(v.b) > 0 {
		buf := make([]byte, len(fp)+len(v.b))
		copy(buf, fp)
		copy(buf[len(fp):], v.b)
		if len(fp) > 0 {
			r.Fingerprint = buf[:len(fp):len(fp)]
		}
		if len(v.b) > 0 {
			r.Result = buf[len(fp):]
		}
	}
	r.Holder = string(holder)
	r.RequestID = string(requestID)
	r.ParkReason = string(parkReason)
	r.Lease = time.Duration(lease) * time.Microsecond
	return nil
}

// normalize makes r what a read of it returns: times in UTC truncated to
// microseconds and the retention in whole microseconds, as a SQL store keeps
// them, so a write's answer and a later Lookup agree on every field.
func normalize(r *storage.Record) {
	r.CreatedAt = truncTime(r.CreatedAt)
	r.LeaseExpiresAt = truncTime(r.LeaseExpiresAt)
	if !r.CompletedAt.IsZero() {
		r.CompletedAt = truncTime(r.CompletedAt)
	}
	r.ExpiresAt = truncTime(r.ExpiresAt)
	r.Retention = r.Retention.Truncate(time.Microsecond)
	r.Lease = r.Lease.Truncate(time.Microsecond)
}

func truncTime(t time.Time) time.Time { return t.Truncate(time.Microsecond).UTC() }
