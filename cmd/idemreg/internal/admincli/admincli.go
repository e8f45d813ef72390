// Package admincli is the admin command of the idemreg binary: an
// operator's calls to a running registry's AdminService (list, inspect,
// resolve, invalidate), made with the credentials a service would use and
// answered as a table, or as JSON (--output json). The binary parses the
// flags each Command binds, the way it parses those of its other commands
// (from the environment, then the arguments), and runs what Bind returned.
package admincli

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/access"
	"github.com/idemreg/idemreg/server/resulttype"
)

// Usage lists the admin commands.
const Usage = `idemreg admin: an operator's calls to a running registry (AdminService), answered as a table
(--output json: one protojson object per line)

  idemreg admin list       [--consumer C | --prefix P] [--state S] [--min-attempt N] [--older-than D]
                           [--page-size N] [--page-token T] [--all]
                           live records in key order, without results, one page at a time (--all:
                           every page); neither --consumer nor --prefix lists every consumer the
                           identity may administer; --state parked|in_progress|completed
  idemreg admin inspect    --consumer C --kind K --key KEY
                           the record as stored, token, result and attempt history included
  idemreg admin resolve    --consumer C --kind K --key KEY --expect-token T --reason TEXT
                           (--release | --response-type TYPE [--response-data S | --response-file F
                                                               | --response-json J | --response-json-file F]
                                      | --failure-code CODE [--failure-message TEXT]) [--descriptor-set F]
                           settle a parked or stuck record the operator inspected (T is its token), or
                           replace a completed record's result that cannot be replayed:
                           --release for a fresh attempt (attempt 1 again), or complete it with a
                           result that every later Claim replays; a response of a type the registry
                           knows (google.protobuf.*, --descriptor-set) must decode as it, and may be
                           given as JSON
  idemreg admin invalidate --consumer C --kind K --key KEY --reason TEXT [--expect-token T]
                           end the record's lease or result: the next Claim takes over

Run "idemreg admin <command> -h" for the flags of a command.
Connection flags (every command): --addr, --token (better IDEMREG_TOKEN), --tls-ca,
--tls-cert and --tls-key (a client certificate), --server-name, --timeout (90s, 1m, 7d),
--output (table or json). A refused call prints "error: <message> (CODE, reason REASON, key=value)"
and exits 1; flags that cannot make a call exit 2.
Without --tls-ca the connection is plaintext, which only a loopback --addr accepts.
`

// adminCall is one command's call, its flags parsed and checked.
type adminCall func(ctx context.Context, api idemregv1.AdminServiceClient) (proto.Message, error)

// Command is one admin command: its synopsis, and Bind, which binds its
// flags (the connection's beside its own) on a flag set and returns what
// runs it once they are parsed. Run's error is a *CallError when the
// server refused or failed the call.
type Command struct {
	Synopsis string
	Bind     func(fs *flag.FlagSet) func(ctx context.Context, stdout io.Writer) error
}

// Commands are the admin commands by name.
var Commands = map[string]Command{
	"list":       command("list", "[--consumer C | --prefix P] [filters] [--all]", bindList),
	"inspect":    command("inspect", "--consumer C --kind K --key KEY", bindInspect),
	"resolve":    command("resolve", "--consumer C --kind K --key KEY --expect-token T --reason TEXT (--release | a result)", bindResolve),
	"invalidate": command("invalidate", "--consumer C --kind K --key KEY --reason TEXT [--expect-token T]", bindInvalidate),
}

// command makes the Command name: the connection flags beside the
// command's own, and its call, made and printed as JSON once they are
// parsed.
func command(name, synopsis string, bind func(fs *flag.FlagSet) func() (adminCall, error)) Command {
	return Command{Synopsis: synopsis, Bind: func(fs *flag.FlagSet) func(context.Context, io.Writer) error {
		var c adminConn
		c.bind(fs)
		output := fs.String("output", OutputTable, "how answers print: table (aligned columns for a person) or json (one protojson object per line, stable spacing, for scripts)")
		prepare := bind(fs)
		return func(ctx context.Context, stdout io.Writer) error {
			print := printTable
			switch *output {
			case OutputTable:
			case OutputJSON:
				print = printJSON
			default:
				return fmt.Errorf("admin %s: %w, got %q", name, errOutput, *output)
			}
			call, err := prepare()
			if err != nil {
				return fmt.Errorf("admin %s: %w", name, err)
			}
			conn, ctx, cancel, err := c.dial(ctx)
			if err != nil {
				return err
			}
			defer cancel()
			defer conn.Close()
			out, err := call(ctx, idemregv1.NewAdminServiceClient(conn))
			if err != nil {
				return &CallError{Err: err}
			}
			return print(stdout, out)
		}
	}}
}

// keyFlags name one record.
type keyFlags struct{ consumer, kind, key string }

func (k *keyFlags) bind(fs *flag.FlagSet) {
	fs.StringVar(&k.consumer, "consumer", "", "the record's consumer")
	fs.StringVar(&k.kind, "kind", "", "the record's kind: message or operation")
	fs.StringVar(&k.key, "key", "", "the record's key")
}

func bindInspect(fs *flag.FlagSet) func() (adminCall, error) {
	var k keyFlags
	k.bind(fs)
	return func() (adminCall, error) {
		kind, err := parseKind(k.kind)
		if err != nil {
			return nil, err
		}
		return func(ctx context.Context, api idemregv1.AdminServiceClient) (proto.Message, error) {
			return api.InspectRecord(ctx, &idemregv1.InspectRecordRequest{Consumer: k.consumer, Kind: kind, Key: k.key})
		}, nil
	}
}

func bindInvalidate(fs *flag.FlagSet) func() (adminCall, error) {
	var k keyFlags
	k.bind(fs)
	reason := fs.String("reason", "", "why, for the audit log and the record's history (required)")
	expect := fs.Int64("expect-token", 0, "act only if this is still the record's token (as inspect showed it)")
	return func() (adminCall, error) {
		kind, err := parseKind(k.kind)
		if err != nil {
			return nil, err
		}
		if strings.TrimSpace(*reason) == "" {
			return nil, errors.New("invalidate needs --reason: it goes to the audit log")
		}
		return func(ctx context.Context, api idemregv1.AdminServiceClient) (proto.Message, error) {
			return api.InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: k.consumer, Kind: kind, Key: k.key, Token: *expect, Reason: *reason})
		}, nil
	}
}

func bindResolve(fs *flag.FlagSet) func() (adminCall, error) {
	var k keyFlags
	k.bind(fs)
	reason := fs.String("reason", "", "why, for the audit log and the record's history (required)")
	expect := fs.Int64("expect-token", 0, "the record's current token, as inspect or list showed it (required): of two operators, only the first acts")
	release := fs.Bool("release", false, "release the record for a fresh attempt: the next Claim acquires it as attempt 1")
	respType := fs.String("response-type", "", "complete with a response of this type (the message's full name, as the service's Complete would store it)")
	respData := fs.String("response-data", "", "the response's bytes in the type's wire format, as given (of a type the registry knows, checked to decode as it)")
	respFile := fs.String("response-file", "", "a file holding the response's bytes in the type's wire format")
	respJSON := fs.String("response-json", "", `the response in the protobuf JSON mapping ('{"value":"10"}' or '"10"' for a google.protobuf.Int64Value), encoded here when the type is known here, else by the server`)
	respJSONFile := fs.String("response-json-file", "", "a file holding the response in the protobuf JSON mapping")
	descSet := fs.String("descriptor-set", "", "binary FileDescriptorSet (buf build -o FILE.binpb) of the response's type, for a type that is not google.protobuf.*: the response is checked and encoded here")
	failCode := fs.String("failure-code", "", "complete with a failure of this google.rpc.Code (1-16, or its name: FAILED_PRECONDITION)")
	failMsg := fs.String("failure-message", "", "the failure's message")
	return func() (adminCall, error) {
		kind, err := parseKind(k.kind)
		if err != nil {
			return nil, err
		}
		if strings.TrimSpace(*reason) == "" {
			return nil, errors.New("resolve needs --reason: it goes to the audit log and the record's history")
		}
		if *expect <= 0 {
			return nil, errors.New("resolve needs --expect-token: the record's token as inspect or list showed it")
		}
		req := &idemregv1.ResolveRecordRequest{Consumer: k.consumer, Kind: kind, Key: k.key, Token: *expect, Reason: *reason}
		response := *respType != "" || *respData != "" || *respFile != "" || *respJSON != "" || *respJSONFile != ""
		failure := *failCode != "" || *failMsg != ""
		switch {
		case *release && (response || failure), response && failure:
			return nil, errors.New("give exactly one of --release, a response (--response-*) or a failure (--failure-*)")
		case *release:
			req.Resolution = &idemregv1.ResolveRecordRequest_Release{Release: true}
		case response:
			types, err := resulttype.Load(*descSet)
			if err != nil {
				return nil, fmt.Errorf("--descriptor-set: %w", err)
			}
			if err := setResponse(req, types, *respType, *respData, *respFile, *respJSON, *respJSONFile); err != nil {
				return nil, err
			}
		case failure:
			code, err := parseCode(*failCode)
			if err != nil {
				return nil, err
			}
			req.Resolution = &idemregv1.ResolveRecordRequest_Result{Result: &idemregv1.Result{
				Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{Code: int32(code), Message: *failMsg}}}}
		default:
			return nil, errors.New("resolve needs --release, a response (--response-type) or a failure (--failure-code)")
		}
		return func(ctx context.Context, api idemregv1.AdminServiceClient) (proto.Message, error) {
			return api.ResolveRecord(ctx, req)
		}, nil
	}
}

// setResponse makes req complete its record with the response of type
// typ that one of the flags gives: as bytes (data,
// file) or as JSON (json, jsonFile). Of a type types know, bytes are
// checked before they are sent, and JSON is encoded here; JSON of a type
// they do not know is sent as JSON, for the server, which may know it
// from its own --descriptor-set.
func setResponse(req *idemregv1.ResolveRecordRequest, types *resulttype.Types, typ, data, file, json, jsonFile string) error {
	given := 0
	for _, f := range []string{data, file, json, jsonFile} {
		if f != "" {
			given++
		}
	}
	if given > 1 {
		return errors.New("--response-data, --response-file, --response-json and --response-json-file each give the response: give one")
	}
	read := func(flag, path string, into *string) error {
		b, err := os.ReadFile(path)
		if err != nil {
			return fmt.Errorf("%s: %w", flag, err)
		}
		*into = string(b)
		return nil
	}
	if file != "" {
		if err := read("--response-file", file, &data); err != nil {
			return err
		}
	}
	if jsonFile != "" {
		if err := read("--response-json-file", jsonFile, &json); err != nil {
			return err
		}
	}
	bytes := []byte(data)
	if json != "" || jsonFile != "" {
		if typ == "" {
			return errors.New("--response-json needs --response-type, the message's full name (such as google.protobuf.Int64Value)")
		}
		if _, known := types.Find(typ); !known {
			req.Resolution = &idemregv1.ResolveRecordRequest_ResponseJson{ResponseJson: &idemregv1.JsonResponse{Type: typ, Json: json}}
			return nil
		}
		var err error
		if bytes, err = types.Encode(typ, json); err != nil {
			return fmt.Errorf("the response is not %s in the protobuf JSON mapping: %w", typ, err)
		}
	} else if _, err := types.Check(typ, bytes); err != nil {
		// The server would refuse it too; said here in the flags' words.
		return fmt.Errorf("the response's bytes do not decode as %s (%v): they must be its wire format; give it as JSON with --response-json, which is encoded for you", typ, err)
	}
	req.Resolution = &idemregv1.ResolveRecordRequest_Result{Result: &idemregv1.Result{
		Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: typ, Data: bytes}}}}
	return nil
}

func bindList(fs *flag.FlagSet) func() (adminCall, error) {
	consumer := fs.String("consumer", "", "list this consumer's records")
	prefix := fs.String("prefix", "", "list the records of the consumers whose name starts with this; without --consumer and --prefix, every consumer the identity may administer")
	state := fs.String("state", "", "only records in this state: parked, in_progress or completed (default: any)")
	minAttempt := fs.Int64("min-attempt", 0, "only records acquired at least this many times")
	var olderThan time.Duration
	durationVar(fs, &olderThan, "older-than", 0, "only records first claimed at least this long ago (default: any)")
	pageSize := fs.Int("page-size", 0, "records per page, 1-500 (default: the server's, 100)")
	pageToken := fs.String("page-token", "", "start at this next_page_token of an earlier page (with the same filters)")
	all := fs.Bool("all", false, "follow next_page_token to the end and print every record as one answer")
	return func() (adminCall, error) {
		if *consumer != "" && *prefix != "" {
			return nil, errors.New("give --consumer or --prefix, not both")
		}
		st, err := parseState(*state)
		if err != nil {
			return nil, err
		}
		if *pageSize < 0 || *pageSize > 500 {
			return nil, fmt.Errorf("--page-size must be between 1 and 500 (0: the server's default), got %d", *pageSize)
		}
		req := &idemregv1.ListRecordsRequest{Consumer: *consumer, ConsumerPrefix: *consumer == "", State: st,
			MinAttempt: *minAttempt, PageSize: int32(*pageSize), PageToken: *pageToken}
		if req.ConsumerPrefix {
			req.Consumer = *prefix
		}
		if olderThan != 0 {
			req.OlderThan = durationpb.New(olderThan)
		}
		return func(ctx context.Context, api idemregv1.AdminServiceClient) (proto.Message, error) {
			if !*all {
				return api.ListRecords(ctx, req)
			}
			// Every page, as one answer: the records in order and the
			// store's clock at the last page.
			out := &idemregv1.ListRecordsResponse{}
			for {
				page, err := api.ListRecords(ctx, req)
				if err != nil {
					return nil, err
				}
				out.Records = append(out.Records, page.GetRecords()...)
				out.StoreTime = page.GetStoreTime()
				if page.GetNextPageToken() == "" {
					return out, nil
				}
				req.PageToken = page.GetNextPageToken()
			}
		}, nil
	}
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

func parseState(s string) (idemregv1.State, error) {
	switch strings.TrimPrefix(strings.ToLower(s), "state_") {
	case "", "any":
		return idemregv1.State_STATE_UNSPECIFIED, nil
	case "in_progress", "in-progress":
		return idemregv1.State_STATE_IN_PROGRESS, nil
	case "completed":
		return idemregv1.State_STATE_COMPLETED, nil
	case "parked":
		return idemregv1.State_STATE_PARKED, nil
	}
	return 0, fmt.Errorf("--state must be parked, in_progress, completed or any, got %q", s)
}

// parseCode reads a google.rpc.Code by number or by name.
func parseCode(s string) (codes.Code, error) {
	if n, err := strconv.ParseUint(s, 10, 32); err == nil {
		return codes.Code(n), nil // the server checks the range
	}
	var c codes.Code
	if err := c.UnmarshalJSON([]byte(strconv.Quote(strings.ToUpper(s)))); err != nil {
		return 0, fmt.Errorf("--failure-code must be a google.rpc.Code, 1-16 or its name (NOT_FOUND, FAILED_PRECONDITION, ...), got %q", s)
	}
	return c, nil
}

// adminConn is how admin reaches a server: the flags a service's client
// would be configured with.
type adminConn struct {
	addr, token, ca, cert, key, serverName string
	timeout                                time.Duration
}

func (c *adminConn) bind(fs *flag.FlagSet) {
	fs.StringVar(&c.addr, "addr", "127.0.0.1:7350", "the server's gRPC address")
	// No default from the environment here: -h prints defaults.
	fs.StringVar(&c.token, "token", "", "bearer token of an identity with an admin grant")
	fs.StringVar(&c.ca, "tls-ca", "", "PEM file of the CA that signed the server's certificate; TLS when set")
	fs.StringVar(&c.cert, "tls-cert", "", "PEM client certificate, for an identity of its subject (with --tls-key)")
	fs.StringVar(&c.key, "tls-key", "", "PEM key of --tls-cert")
	fs.StringVar(&c.serverName, "server-name", "", "name to verify the server's certificate against (default: --addr's host)")
	durationVar(fs, &c.timeout, "timeout", 10*time.Second, "give up after this long (for list --all, on every page together)")
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
	} else if !access.Loopback(c.addr) {
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
