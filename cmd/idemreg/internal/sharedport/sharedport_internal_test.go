package sharedport

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCORSOrigins(t *testing.T) {
	tests := []struct {
		name, list string
		want       []string
		wantErr    bool
	}{
		{name: "none", list: "", want: nil},
		{name: "two, trimmed and normalised", list: " https://app.example.com, http://localhost:3000/ ", want: []string{"https://app.example.com", "http://localhost:3000"}},
		{name: "any", list: "*", want: []string{"*"}},
		{name: "a path", list: "https://app.example.com/page", wantErr: true},
		{name: "no scheme", list: "app.example.com", wantErr: true},
		{name: "another scheme", list: "ftp://app.example.com", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := CORSOrigins(tt.list)
			if tt.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
		})
	}
}

func TestAPIPath(t *testing.T) {
	for p, want := range map[string]bool{
		"/idemreg.v1.RegistryService/Claim": true,
		"/grpc.health.v1.Health/Check":      true,
		"/":                                 false,
		"/index.html":                       false,
		"/idemreg.v1.RegistryService/":      false,
		"/idemreg.v1.RegistryService/a/b":   false,
		"/Service/Method":                   false,
		"idemreg.v1.RegistryService/Claim":  false,
	} {
		require.Equal(t, want, apiPath(p), p)
	}
}
