package client_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/metadata"

	"github.com/idemreg/idemreg/client"
)

// TestIdempotencyKey covers where the key of an outgoing call comes from.
// The metadata cases run on every gRPC the module accepts
// (.ci/client-minversions runs them on the lowest).
func TestIdempotencyKey(t *testing.T) {
	tests := []struct {
		name   string
		ctx    context.Context
		want   string
		wantOK bool
	}{
		{name: "none", ctx: context.Background()},
		{
			name: "appended metadata",
			ctx:  metadata.AppendToOutgoingContext(context.Background(), client.KeyMetadata, "k-1"),
			want: "k-1", wantOK: true,
		},
		{
			name: "metadata with an upper-case key",
			ctx:  metadata.NewOutgoingContext(context.Background(), metadata.MD{"Idempotency-Key": {"k-2"}}),
			want: "k-2", wantOK: true,
		},
		{
			name: "the first of several values",
			ctx: metadata.AppendToOutgoingContext(
				metadata.NewOutgoingContext(context.Background(), metadata.Pairs(client.KeyMetadata, "k-3")),
				client.KeyMetadata, "k-4"),
			want: "k-3", wantOK: true,
		},
		{
			name: "an empty value is no key",
			ctx:  metadata.AppendToOutgoingContext(context.Background(), client.KeyMetadata, ""),
		},
		{
			name: "the context's key wins over the metadata",
			ctx: client.WithIdempotencyKey(
				metadata.AppendToOutgoingContext(context.Background(), client.KeyMetadata, "from-md"), "from-ctx"),
			want: "from-ctx", wantOK: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := client.IdempotencyKey(tt.ctx)
			if got != tt.want || ok != tt.wantOK {
				t.Errorf("IdempotencyKey = %q, %v; want %q, %v", got, ok, tt.want, tt.wantOK)
			}
		})
	}
}
