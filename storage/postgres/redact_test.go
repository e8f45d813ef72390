package postgres_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemreg/idemreg/storage/postgres"
)

// secret is the password of every connection string below; no redacted
// string and no error may contain it.
const secret = "S3cretPw"

func TestRedact(t *testing.T) {
	cases := []struct{ name, in, want string }{
		{"URL userinfo", "postgres://u:S3cretPw@db:5432/idemreg?sslmode=disable", "postgres://u:xxxxx@db:5432/idemreg?sslmode=disable"},
		{"URL without password", "postgresql://u@db/idemreg", "postgresql://u@db/idemreg"},
		{"password parameter", "postgres://u@db/idemreg?sslmode=disable&password=S3cretPw&pool_max_conns=4", "postgres://u@db/idemreg?sslmode=disable&password=xxxxx&pool_max_conns=4"},
		{"sslpassword parameter", "postgres://u@db/idemreg?sslpassword=S3cretPw", "postgres://u@db/idemreg?sslpassword=xxxxx"},
		{"escaped parameter name", "postgres://u@db/idemreg?pass%77ord=S3cretPw", "postgres://u@db/idemreg?pass%77ord=xxxxx"},
		{"inline client key", "postgres://u@db/idemreg?sslinline=true&sslkey=-----BEGIN%20PRIVATE%20KEY-----S3cretPw", "postgres://u@db/idemreg?sslinline=true&sslkey=xxxxx"},
		{"client key file", "postgres://u@db/idemreg?sslkey=/certs/client.key", "postgres://u@db/idemreg?sslkey=/certs/client.key"},
		{"both", "postgres://u:S3cretPw@db/idemreg?password=S3cretPw", "postgres://u:xxxxx@db/idemreg?password=xxxxx"},
		{"unparseable URL", "postgres://u:S3cretPw@db:badport/idemreg?password=S3cretPw", "postgres://u:xxxxx@db:badport/idemreg?password=xxxxx"},
		{"key=value", "host=db user=u password=S3cretPw sslmode=disable", "host=db user=u password=xxxxx sslmode=disable"},
		{"key = value", "host=db password = S3cretPw user=u", "host=db password = xxxxx user=u"},
		{"quoted with an escaped quote", `host=db password='S3c \'ret Pw' user=u`, "host=db password=xxxxx user=u"},
		{"first key", "password=S3cretPw host=db", "password=xxxxx host=db"},
		{"upper case", "host=db PASSWORD=S3cretPw", "host=db PASSWORD=xxxxx"},
		{"sslpassword", "host=db sslpassword=S3cretPw", "host=db sslpassword=xxxxx"},
		{"in a flag", "--database-url=password=S3cretPw host=db", "--database-url=password=xxxxx host=db"},
		{"URL in a flag", "--database-url=postgres://u:S3cretPw@db/x?password=S3cretPw", "--database-url=postgres://u:xxxxx@db/x?password=xxxxx"},
		{"not a connection string", "--listen=127.0.0.1:7350", "--listen=127.0.0.1:7350"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := postgres.Redact(tc.in)
			require.Equal(t, tc.want, got)
			require.NotContains(t, got, "S3c")
		})
	}
}

// TestOpenAndMigrateErrorsHideSecrets gives Open and Migrate connection
// strings that fail, in every form a password can take, including those
// pgx's own redaction misses ("password = secret"): no error shows it.
func TestOpenAndMigrateErrorsHideSecrets(t *testing.T) {
	cases := []struct{ name, conn string }{
		{"URL, bad port", "postgres://u:S3cretPw@127.0.0.1:badport/db"},
		{"URL, escaped password, bad port", "postgres://u:S3cret%50w@127.0.0.1:badport/db"},
		{"password parameter, bad parameter", "postgres://u@127.0.0.1:1/db?password=S3cretPw&connect_timeout=x"},
		{"sslpassword parameter, bad parameter", "postgres://u@127.0.0.1:1/db?sslpassword=S3cretPw&pool_max_conns=x"},
		{"key=value, bad port", "host=127.0.0.1 port=bad user=u password=S3cretPw"},
		{"key = value, bad port", "host=127.0.0.1 port=bad user=u password = S3cretPw"},
		{"quoted, bad port", `host=127.0.0.1 port=bad user=u password='S3cretPw x'`},
		{"unreachable", "postgres://u:S3cretPw@127.0.0.1:1/db?sslmode=disable&connect_timeout=1"},
		{"key=value, unreachable", "host=127.0.0.1 port=1 user=u password = S3cretPw sslmode=disable connect_timeout=1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			err := postgres.Migrate(ctx, tc.conn)
			require.Error(t, err)
			require.NotContains(t, err.Error(), secret, "Migrate")
			require.NotContains(t, err.Error(), "S3cretP", "Migrate, unescaped")
			s, err := postgres.Open(ctx, tc.conn)
			if err == nil { // connections are made on demand
				s.Close()
				require.False(t, strings.Contains(tc.conn, "bad") || strings.Contains(tc.conn, "=x"), "should not parse")
				return
			}
			require.NotContains(t, err.Error(), "S3cretP", "Open")
		})
	}
}
