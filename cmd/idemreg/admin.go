package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// adminUsage lists the admin subcommands. list and resolve need
// AdminService calls that do not exist yet (issue 15).
const adminUsage = `idemreg admin: an operator's calls to a running registry

  idemreg admin inspect    --consumer C --kind K --key KEY   the record as stored, token and result included
  idemreg admin invalidate --consumer C --kind K --key KEY --reason TEXT [--expect-token T]
                           end the record's lease or result: the next Claim takes over

Connection flags (every subcommand): --addr, --token (or IDEMREG_TOKEN), --tls-ca,
--tls-cert and --tls-key (a client certificate), --server-name, --timeout.
Without --tls-ca the connection is plaintext, which only a loopback --addr accepts.
`

// admin runs an AdminService call against a server, with the credentials
// a service would use, and prints the answer as JSON.
func admin(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stdout, adminUsage)
		if len(args) == 0 {
			return errors.New("no admin command given")
		}
		return nil
	}
	cmd := args[0]
	fs := flag.NewFlagSet("idemreg admin "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	c := adminConn{}
	c.bind(fs)
	consumer := fs.String("consumer", "", "the record's consumer")
	kind := fs.String("kind", "", "message or operation")
	key := fs.String("key", "", "the record's key")
	reason := fs.String("reason", "", "invalidate: why, for the audit log (required)")
	expect := fs.Int64("expect-token", 0, "invalidate: act only if this is still the record's token (as inspect showed it)")
	if err := parse(fs, args[1:]); err != nil {
		return err
	}
	k, err := parseKind(*kind)
	if err != nil {
		return err
	}
	conn, ctx, cancel, err := c.dial(ctx)
	if err != nil {
		return err
	}
	defer cancel()
	defer conn.Close()
	api := idemregv1.NewAdminServiceClient(conn)
	var out proto.Message
	switch cmd {
	case "inspect":
		out, err = api.InspectRecord(ctx, &idemregv1.InspectRecordRequest{Consumer: *consumer, Kind: k, Key: *key})
	case "invalidate":
		if strings.TrimSpace(*reason) == "" {
			return errors.New("invalidate needs --reason: it goes to the audit log")
		}
		out, err = api.InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: *consumer, Kind: k, Key: *key, Token: *expect, Reason: *reason})
	default:
		fmt.Fprint(stderr, adminUsage)
		return fmt.Errorf("unknown admin command %q", cmd)
	}
	if err != nil {
		return &exitError{code: 1, err: fmt.Errorf("admin %s: %w", cmd, err)}
	}
	b, err := protojson.MarshalOptions{Multiline: true, Indent: "  "}.Marshal(out)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(stdout, string(b))
	return err
}

func parseKind(s string) (idemregv1.Kind, error) {
	switch strings.ToLower(s) {
	case "message", "kind_message":
		return idemregv1.Kind_KIND_MESSAGE, nil
	case "operation", "kind_operation":
		return idemregv1.Kind_KIND_OPERATION, nil
	}
	return 0, fmt.Errorf("--kind must be message or operation, got %q", s)
}

// adminConn is how admin reaches a server: the flags a service's client
// would be configured with.
type adminConn struct {
	addr, token, ca, cert, key, serverName string
	timeout                                time.Duration
}

func (c *adminConn) bind(fs *flag.FlagSet) {
	fs.StringVar(&c.addr, "addr", "127.0.0.1:7350", "the server's gRPC address")
	fs.StringVar(&c.token, "token", os.Getenv("IDEMREG_TOKEN"), "bearer token of an identity with an admin grant (IDEMREG_TOKEN)")
	fs.StringVar(&c.ca, "tls-ca", "", "PEM file of the CA that signed the server's certificate; TLS when set")
	fs.StringVar(&c.cert, "tls-cert", "", "PEM client certificate, for an identity of its subject (with --tls-key)")
	fs.StringVar(&c.key, "tls-key", "", "PEM key of --tls-cert")
	fs.StringVar(&c.serverName, "server-name", "", "name to verify the server's certificate against (default: --addr's host)")
	fs.DurationVar(&c.timeout, "timeout", 10*time.Second, "give up after this long")
}

func (c *adminConn) dial(ctx context.Context) (*grpc.ClientConn, context.Context, context.CancelFunc, error) {
	creds := insecure.NewCredentials()
	if c.ca != "" {
		pem, err := os.ReadFile(c.ca)
		if err != nil {
			return nil, nil, nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, nil, nil, fmt.Errorf("--tls-ca %s holds no PEM certificate", c.ca)
		}
		cfg := &tls.Config{RootCAs: pool, ServerName: c.serverName, MinVersion: tls.VersionTLS12}
		if c.cert != "" || c.key != "" {
			pair, err := tls.LoadX509KeyPair(c.cert, c.key)
			if err != nil {
				return nil, nil, nil, fmt.Errorf("client certificate: %w", err)
			}
			cfg.Certificates = []tls.Certificate{pair}
		}
		creds = credentials.NewTLS(cfg)
	} else if !isLoopback(c.addr) {
		return nil, nil, nil, fmt.Errorf("--addr %s is not loopback: give --tls-ca, so that the token and the records do not travel in plaintext", c.addr)
	}
	conn, err := grpc.NewClient(c.addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	if c.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.token)
	}
	return conn, ctx, cancel, nil
}
