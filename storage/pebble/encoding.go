package pebble

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/idemreg/idemreg/storage"
)

// Key space. The first byte of every key says what it is, so the families
// never interleave and each can be walked on its own.
const (
	prefixMeta   byte = 0x00
	prefixRecord byte = 0x01
	prefixExpiry byte = 0x02
	prefixParked byte = 0x03
)

var (
	// metaFormat holds the layout version of the data directory.
	metaFormat = []byte{prefixMeta, 'f', 'o', 'r', 'm', 'a', 't'}
	// metaTokenFloor holds the greatest token of any record the sweeper
	// deleted: the token a deleted key's next claim must exceed.
	metaTokenFloor = []byte{prefixMeta, 't', 'o', 'k', 'e', 'n', '-', 'f', 'l', 'o', 'o', 'r'}
	// metaClaimKey holds the claim key (storage.ClaimKeys).
	metaClaimKey = []byte{prefixMeta, 'c', 'l', 'a', 'i', 'm', '-', 'k', 'e', 'y'}
	// metaClaimKeys holds the claim keys by generation (encodeClaimKeys);
	// generation 1 is metaClaimKey's.
	metaClaimKeys = []byte{prefixMeta, 'c', 'l', 'a', 'i', 'm', '-', 'k', 'e', 'y', 's'}
)

// layoutVersion is the version of the key layout and of metaFormat.
// Version 2 added the parked index; Open builds it in a directory of
// version 1 (migrateV1). The version is what keeps a binary that does not
// maintain the index out of a directory that has one.
const (
	layoutVersion   byte = 2
	layoutVersionV1 byte = 1
)

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

// A parked index key is prefixParked followed by the record key of a record
// whose state is StateParked, so the index sorts like the records, by
// (consumer, kind, key), and a consumer's or a prefix's parked records are
// one range. Its value is the record's expires_at in microseconds, biased
// big-endian like the expiry index, so a count of live parked records reads
// the index alone.
const parkedValueSize = 8

func appendParkedKey(dst, recordKey []byte) []byte {
	return append(append(dst, prefixParked), recordKey...)
}

func appendParkedValue(dst []byte, expiresAt time.Time) []byte {
	return binary.BigEndian.AppendUint64(dst, uint64(expiresAt.UnixMicro())^timeBias)
}

func decodeParkedValue(b []byte) (time.Time, error) {
	if len(b) != parkedValueSize {
		return time.Time{}, fmt.Errorf("pebble: malformed parked index value %x", b)
	}
	return time.UnixMicro(int64(binary.BigEndian.Uint64(b) ^ timeBias)).UTC(), nil
}

// consumerPrefix is the start of the record keys of the consumer, up to its
// terminator, or with prefix of the record keys of every consumer whose
// name starts with consumer. Escaping is byte by byte, so an escaped prefix
// starts the escaped names that start with it and no other: where an
// escaped name ends with the terminator 0x00 0x01, an escaped prefix that
// goes on has 0x00 0xFF or a byte that is not 0x00.
func consumerPrefix(consumer string, prefix bool) []byte {
	b := appendRecordKey(nil, storage.Key{Consumer: consumer})
	b = b[:len(b)-1] // without the kind
	if prefix {
		b = b[:len(b)-2]
	}
	return b
}

// prefixEnd is the least key greater than every key that starts with b,
// nil when there is none (b is all 0xFF).
func prefixEnd(b []byte) []byte {
	end := bytes.Clone(b)
	for i := len(end) - 1; i >= 0; i-- {
		if end[i] != 0xFF {
			end[i]++
			return end[:i+1]
		}
	}
	return nil
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
// Version 4 is version 3 with, after the park reason, the history: a
// uvarint count, then per attempt, oldest first, token varint | attempt
// uvarint | ended_at varint µs | end byte | holder, park reason and note,
// each uvarint length + bytes. It is written only for a record that has a
// history, so records that never changed hands keep the older layouts.
//
// The key is not repeated: it is the record key.
const (
	valueVersion1   byte = 1
	valueVersion2   byte = 2
	valueVersion3   byte = 3
	valueVersion4   byte = 4
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
	version := valueVersion(r)
	if version >= valueVersion2 {
		n += uvarintLen(uint64(len(r.RequestID))) + len(r.RequestID) + varintLen(r.Lease.Microseconds())
	}
	if version >= valueVersion3 {
		n += uvarintLen(uint64(len(r.ParkReason))) + len(r.ParkReason)
	}
	if version >= valueVersion4 {
		n += uvarintLen(uint64(len(r.History)))
		for i := range r.History {
			a := &r.History[i]
			n += varintLen(a.Token) + uvarintLen(uint64(a.Attempt)) + varintLen(a.EndedAt.UnixMicro()) + 1 +
				uvarintLen(uint64(len(a.Holder))) + len(a.Holder) +
				uvarintLen(uint64(len(a.ParkReason))) + len(a.ParkReason) +
				uvarintLen(uint64(len(a.Note))) + len(a.Note)
		}
	}
	return n
}

// valueVersion is the layout appendRecord uses for r.
func valueVersion(r *storage.Record) byte {
	if len(r.History) > 0 {
		return valueVersion4
	}
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
	if version >= valueVersion3 {
		dst = appendBytes(dst, r.ParkReason)
	}
	if version >= valueVersion4 {
		dst = binary.AppendUvarint(dst, uint64(len(r.History)))
		for i := range r.History {
			a := &r.History[i]
			dst = binary.AppendVarint(dst, a.Token)
			dst = binary.AppendUvarint(dst, uint64(a.Attempt))
			dst = binary.AppendVarint(dst, a.EndedAt.UnixMicro())
			dst = append(dst, byte(a.End))
			dst = appendBytes(dst, a.Holder)
			dst = appendBytes(dst, a.ParkReason)
			dst = appendBytes(dst, a.Note)
		}
	}
	return append(dst, r.Result...)
}

func appendBytes(dst []byte, s string) []byte {
	return append(binary.AppendUvarint(dst, uint64(len(s))), s...)
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

func (v *valueReader) uvarint() uint64 {
	x, n := binary.Uvarint(v.b)
	if n <= 0 {
		v.bad = true
		return 0
	}
	v.b = v.b[n:]
	return x
}

func (v *valueReader) byte() byte {
	if len(v.b) == 0 {
		v.bad = true
		return 0
	}
	c := v.b[0]
	v.b = v.b[1:]
	return c
}

func (v *valueReader) time() time.Time { return time.UnixMicro(v.varint()).UTC() }

// history reads a version 4 history; nil when it has no entry.
func (v *valueReader) history() []storage.Attempt {
	n := v.uvarint()
	if n > uint64(len(v.b)) {
		// Every entry takes at least 7 bytes: the count is malformed, not
		// an allocation to make.
		v.bad = true
	}
	if v.bad || n == 0 {
		return nil
	}
	h := make([]storage.Attempt, n)
	for i := range h {
		a := &h[i]
		a.Token = v.varint()
		a.Attempt = int64(v.uvarint())
		a.EndedAt = v.time()
		a.End = storage.AttemptEnd(v.byte())
		a.Holder = string(v.bytes())
		a.ParkReason = string(v.bytes())
		a.Note = string(v.bytes())
		if v.bad {
			return nil
		}
	}
	return h
}

// decodeRecord fills r (whose Key the caller sets) from a value. It copies
// what it keeps, so b may be released afterwards.
func decodeRecord(b []byte, r *storage.Record) error { return decodeValue(b, r, true) }

// decodeRecordMeta is decodeRecord without the result, which a listing
// does not return and need not copy.
func decodeRecordMeta(b []byte, r *storage.Record) error { return decodeValue(b, r, false) }

func decodeValue(b []byte, r *storage.Record, withResult bool) error {
	if len(b) < 3 {
		return errBadValue
	}
	version := b[0]
	if version < valueVersion1 || version > valueVersion4 {
		return fmt.Errorf("pebble: unknown record value version %d", b[0])
	}
	r.State = storage.State(b[1])
	flags := b[2]
	v := valueReader{b: b[3:]}
	r.Token = v.varint()
	r.Attempt = int64(v.uvarint())
	if v.bad {
		return errBadValue
	}
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
	if version >= valueVersion3 {
		parkReason = v.bytes()
	}
	r.History = nil
	if version >= valueVersion4 {
		r.History = v.history()
	}
	if v.bad {
		return errBadValue
	}
	if !withResult {
		v.b = nil
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
	for i := range r.History {
		r.History[i].EndedAt = truncTime(r.History[i].EndedAt)
	}
}

func truncTime(t time.Time) time.Time { return t.Truncate(time.Microsecond).UTC() }
