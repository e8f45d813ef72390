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
// A replayed message only wakes waiters to decide again.
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

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

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
	From string    `json:"f"`
	To   string    `json:"t"`
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

// Receiver answers the Wake calls of peers: it wakes this replica's
// waiters on each key named.
type Receiver struct {
	self   string
	seal   *sealers
	notify func(storage.Key)
}

// NewReceiver answers Wakes addressed to self, sealed under keys, by
// calling notify for each key.
func NewReceiver(self string, keys Keys, notify func(storage.Key)) *Receiver {
	return &Receiver{self: self, seal: &sealers{keys: keys}, notify: notify}
}

// Wake wakes the waiters on the keys of a sealed message. A message that
// does not open is UNAUTHENTICATED; one meant for another replica (a new
// process on the address of one that is gone) wakes nothing.
func (r *Receiver) Wake(ctx context.Context, in *wrapperspb.BytesValue) (*emptypb.Empty, error) {
	m, err := r.seal.open(ctx, in.GetValue())
	switch {
	case errors.Is(err, errUnsealed):
		return nil, status.Error(codes.Unauthenticated, "not a replica of this store")
	case errors.Is(err, storage.ErrUnavailable):
		return nil, status.Error(codes.Unavailable, "claim keys unavailable")
	case err != nil:
		return nil, status.Error(codes.InvalidArgument, "malformed wake")
	}
	if m.To != r.self {
		return &emptypb.Empty{}, nil
	}
	for _, k := range m.Keys {
		r.notify(storage.Key{Consumer: k.Consumer, Kind: storage.Kind(k.Kind), Key: k.Key})
	}
	return &emptypb.Empty{}, nil
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
