// Package peers tells other replicas that attempts their Claims wait for
// have ended, over an internal RPC between replicas on their gRPC port.
//
// A Claim waiting on one replica for a key in progress marks the record
// with its replica (storage.WaitMarker); the replica whose Complete,
// Release, Park, Invalidate or Resolve ends the attempt finds the marks in
// the answer of its own statement (storage.Record.Waiters) and tells each
// replica named (Sender.Tell), which wakes its waiters on the key
// (Receiver, waiting.Hub.Notify); they decide again with the store, as
// after a change through their own replica. Telling is fire and forget:
// Tell only queues, one goroutine per peer sends what is queued as one
// call with a short timeout, and a call that fails or a peer that is not
// live (membership) is given up: its waiters notice by their re-check
// (--wait-recheck), as before there was any telling.
//
// The RPC is idemreg.internal.peers.v1.Peers/Wake, a unary call whose
// request is a google.protobuf.BytesValue: the message sealed with
// AES-256-GCM under a key derived from the store's claim key
// (storage.ClaimKeys), which every replica sharing the store reads and
// nothing else has. Sealing authenticates the sender as a replica of this
// store and hides the keys named from anyone on the path, whatever the
// transport; the gRPC server's authentication is skipped for the service
// (server/authn.go, public), and its own TLS, when it serves TLS, is not
// verified by name (peers dial pod IPs that certificates do not name).
//
// Sealing alone does not stop a replay: a message captured on the path
// opens as well the thousandth time, and each one made the key's waiters
// decide again with the store (issue 35: 72,449 replays in 9 s, 2,898
// record UPDATEs). So each message carries, under the seal, a sequence
// that is its sender's clock in nanoseconds, strictly increasing per
// sender (Sender.next), and a receiver takes a message only when that
// sequence is within DefaultFreshness of its own clock and above the last
// one it took from the same sender; anything else is refused
// PERMISSION_DENIED and wakes nothing. A sender sends to one peer a call
// at a time, so its messages arrive in the order they were sealed; one
// that times out and arrives after the next is refused, which costs only
// its waiters a re-check.
package peers

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/reason"
	"github.com/idemreg/idemreg/storage"
)

// ServiceName is the internal service's name, for the server's chain.
const ServiceName = "idemreg.internal.peers.v1.Peers"

const wakeMethod = "/" + ServiceName + "/Wake"

// Keys gives the sealing keys: the store's claim keys, by generation.
type Keys interface {
	// Current is the generation to seal under and its key.
	Current(ctx context.Context) (gen int64, key []byte, err error)
	// Generation is the key of gen, false when it is not accepted.
	Generation(ctx context.Context, gen int64) (key []byte, ok bool, err error)
}

// message is what a Wake carries, sealed.
type message struct {
	From string `json:"f"`
	To   string `json:"t"`
	// Seq is the sender's clock when it sealed the message, in Unix
	// nanoseconds, made strictly increasing per sender: the receiver's
	// freshness bound. Zero (a sender before Seq) is never fresh.
	Seq  int64     `json:"s"`
	Keys []wireKey `json:"k"`
}

type wireKey struct {
	Consumer string `json:"c"`
	Kind     uint8  `json:"n"`
	Key      string `json:"k"`
}

// sealers derives and keeps the AEAD of each generation.
type sealers struct {
	keys Keys
	mu   sync.Mutex
	by   map[int64]cipher.AEAD
}

// label separates the peers' key from every other use of the claim key.
const label = "idemreg peers wake v1"

func derive(key []byte) (cipher.AEAD, error) {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(label))
	block, err := aes.NewCipher(mac.Sum(nil))
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(block)
}

func (s *sealers) get(gen int64, key []byte) (cipher.AEAD, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.by[gen]; a != nil {
		return a, nil
	}
	a, err := derive(key)
	if err != nil {
		return nil, err
	}
	if s.by == nil {
		s.by = map[int64]cipher.AEAD{}
	}
	s.by[gen] = a
	return a, nil
}

// seal is gen (8 bytes) || nonce || ciphertext of m.
func (s *sealers) seal(ctx context.Context, m message) ([]byte, error) {
	gen, key, err := s.keys.Current(ctx)
	if err != nil {
		return nil, err
	}
	a, err := s.get(gen, key)
	if err != nil {
		return nil, err
	}
	plain, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	out := make([]byte, 8+a.NonceSize(), 8+a.NonceSize()+len(plain)+a.Overhead())
	binary.BigEndian.PutUint64(out, uint64(gen))
	_, _ = rand.Read(out[8:]) // never fails (crypto/rand)
	return a.Seal(out, out[8:], plain, []byte(ServiceName)), nil
}

var errUnsealed = errors.New("peers: message not sealed under an accepted claim key")

func (s *sealers) open(ctx context.Context, b []byte) (message, error) {
	var m message
	if len(b) < 8 {
		return m, errUnsealed
	}
	gen := int64(binary.BigEndian.Uint64(b))
	key, ok, err := s.keys.Generation(ctx, gen)
	if err != nil {
		return m, err
	}
	if !ok {
		return m, errUnsealed
	}
	a, err := s.get(gen, key)
	if err != nil {
		return m, err
	}
	if len(b) < 8+a.NonceSize() {
		return m, errUnsealed
	}
	plain, err := a.Open(nil, b[8:8+a.NonceSize()], b[8+a.NonceSize():], []byte(ServiceName))
	if err != nil {
		return m, errUnsealed
	}
	if err := json.Unmarshal(plain, &m); err != nil {
		return m, fmt.Errorf("peers: decode: %w", err)
	}
	return m, nil
}

// DefaultFreshness is how far a Wake's sequence (its sender's clock) may
// be from the receiver's clock, either way, for the Wake to be taken. It
// is the replicas' clock skew tolerated: NTP keeps hosts within
// milliseconds, and a sender further off has its Wakes refused, its
// peers' waiters left to their re-checks (--wait-recheck), as a peer not
// told. It also bounds the replay of a message captured before the
// receiver restarted (and so forgot its senders' last sequences): at
// most once, within DefaultFreshness of its sealing.
const DefaultFreshness = 30 * time.Second

// The results of a Wake received, the values of the "result" attribute
// of idemreg.peer.wakes.received.
const (
	Woken     = "woken"         // fresh, for this replica: its keys' waiters woken
	Stale     = "stale"         // sealed outside DefaultFreshness of this replica's clock
	Replayed  = "replayed"      // a sequence this replica took already from that sender
	Misrouted = "other_replica" // meant for another replica: nothing woken
	Unsealed  = "unsealed"      // not sealed under an accepted claim key
)

// Receiver answers the Wake calls of peers: it wakes this replica's
// waiters on each key named.
type Receiver struct {
	self      string
	seal      *sealers
	notify    func(storage.Key)
	now       func() time.Time
	freshness time.Duration
	count     func(result string)

	mu sync.Mutex
	// last is the last sequence taken from each sender. Only sealed
	// messages add to it, so its size is the senders that are replicas
	// of this store, forgotten once their last sequence is stale.
	last      map[string]int64
	lastPrune time.Time
}

// ReceiverOption configures a Receiver.
type ReceiverOption func(*Receiver)

// WithClock makes now the receiver's clock (time.Now).
func WithClock(now func() time.Time) ReceiverOption { return func(r *Receiver) { r.now = now } }

// WithFreshness replaces DefaultFreshness.
func WithFreshness(d time.Duration) ReceiverOption { return func(r *Receiver) { r.freshness = d } }

// WithCount is told the result of each Wake received.
func WithCount(count func(result string)) ReceiverOption {
	return func(r *Receiver) { r.count = count }
}

// NewReceiver answers Wakes addressed to self, sealed under keys, by
// calling notify for each key.
func NewReceiver(self string, keys Keys, notify func(storage.Key), opts ...ReceiverOption) *Receiver {
	r := &Receiver{self: self, seal: &sealers{keys: keys}, notify: notify, now: time.Now,
		freshness: DefaultFreshness, count: func(string) {}, last: map[string]int64{}}
	for _, o := range opts {
		o(r)
	}
	return r
}

// Wake wakes the waiters on the keys of a sealed message. A message that
// does not open is UNAUTHENTICATED; one that is not fresh (stale, or
// replayed) is PERMISSION_DENIED and wakes nothing; one meant for
// another replica (a new process on the address of one that is gone)
// wakes nothing.
func (r *Receiver) Wake(ctx context.Context, in *wrapperspb.BytesValue) (*emptypb.Empty, error) {
	m, err := r.seal.open(ctx, in.GetValue())
	switch {
	case errors.Is(err, errUnsealed):
		r.count(Unsealed)
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_UNAUTHENTICATED, "not a replica of this store", nil)
	case errors.Is(err, storage.ErrUnavailable):
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_STORE_UNAVAILABLE, "claim keys unavailable", nil)
	case err != nil:
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_MALFORMED_REQUEST, "malformed wake", nil)
	}
	now := r.now()
	if d := now.Sub(time.Unix(0, m.Seq)); d > r.freshness || d < -r.freshness {
		r.count(Stale)
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_PERMISSION_DENIED,
			"wake sealed outside the freshness window of this replica's clock", map[string]string{"wake": Stale})
	}
	if m.To != r.self {
		r.count(Misrouted)
		return &emptypb.Empty{}, nil
	}
	if !r.take(now, m.From, m.Seq) {
		r.count(Replayed)
		return nil, reason.Status(idemregv1.ErrorReason_ERROR_REASON_PERMISSION_DENIED,
			"wake already taken: a replay", map[string]string{"wake": Replayed})
	}
	r.count(Woken)
	for _, k := range m.Keys {
		r.notify(storage.Key{Consumer: k.Consumer, Kind: storage.Kind(k.Kind), Key: k.Key})
	}
	return &emptypb.Empty{}, nil
}

// take records seq as from's last and reports true when it is above the
// last taken from that sender.
func (r *Receiver) take(now time.Time, from string, seq int64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if seq <= r.last[from] {
		return false
	}
	r.last[from] = seq
	// A sender silent for longer than the window has nothing left to
	// replay that the window does not refuse: forget it, at most once a
	// window so that this stays O(1) per call.
	if now.Sub(r.lastPrune) > r.freshness {
		r.lastPrune = now
		horizon := now.Add(-r.freshness).UnixNano()
		for id, s := range r.last {
			if s < horizon {
				delete(r.last, id)
			}
		}
	}
	return true
}

// serviceDesc is written by hand: one unary method on well-known types,
// which needs no generated code.
var serviceDesc = grpc.ServiceDesc{
	ServiceName: ServiceName,
	HandlerType: (*interface {
		Wake(context.Context, *wrapperspb.BytesValue) (*emptypb.Empty, error)
	})(nil),
	Methods: []grpc.MethodDesc{{MethodName: "Wake", Handler: wakeHandler}},
	Streams: []grpc.StreamDesc{},
}

func wakeHandler(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
	in := new(wrapperspb.BytesValue)
	if err := dec(in); err != nil {
		return nil, err
	}
	if interceptor == nil {
		return srv.(*Receiver).Wake(ctx, in)
	}
	info := &grpc.UnaryServerInfo{Server: srv, FullMethod: wakeMethod}
	return interceptor(ctx, in, info, func(ctx context.Context, req any) (any, error) {
		return srv.(*Receiver).Wake(ctx, req.(*wrapperspb.BytesValue))
	})
}

// Register registers r on s.
func Register(s grpc.ServiceRegistrar, r *Receiver) { s.RegisterService(&serviceDesc, r) }
