package server

import (
	"context"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
)

// actAsHeader names, on an InProcess connection only, the identity of the
// config file a call is made as.
const actAsHeader = "idemreg-act-as"

// inProcessBuffer is the in-process connection's buffer each way.
const inProcessBuffer = 1 << 20

// InProcess returns a connection to the server's services that only this
// process can open: its bytes never leave the process, so it skips
// Config.TLS, and a call on it may name the identity it is made as
// (ActAs), which no network peer can. It is how the operator console of
// the same binary acts as the operator who signed in to it, whether the
// operator's identity authenticates by a bearer token, a client
// certificate (which a browser's session cannot forward), or a trusted
// proxy's header. Every call still goes through the whole middleware chain
// (access log, authorization, limits) as that identity. The connection
// serves until it is closed or the server stops.
func (s *Server) InProcess() (*InProcessConn, error) {
	lis := bufconn.Listen(inProcessBuffer)
	conn, err := grpc.NewClient("passthrough:///in-process",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	go func() { _ = s.grpc.Serve(inProcessListener{lis}) }()
	return &InProcessConn{ClientConn: conn, lis: lis}, nil
}

// InProcessConn is a connection of InProcess.
type InProcessConn struct {
	*grpc.ClientConn
	lis *bufconn.Listener
}

// Close closes the connection and stops serving it.
func (c *InProcessConn) Close() error {
	err := c.ClientConn.Close()
	_ = c.lis.Close()
	return err
}

// ActAs returns ctx for a call on an InProcess connection made as the
// identity of the config file named name; the call is UNAUTHENTICATED when
// the config in force has no such identity. On any other connection the
// name is ignored.
func ActAs(ctx context.Context, name string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, actAsHeader, name)
}

// inProcessListener marks the connections of an InProcess listener, which
// no network peer can make, for inProcessCreds.
type inProcessListener struct{ *bufconn.Listener }

func (l inProcessListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return inProcessConn{c}, nil
}

type inProcessConn struct{ net.Conn }

// inProcessCreds are the server's transport credentials (TLS, or none)
// for every connection but an InProcess one, which has no handshake and
// inProcessAuth as its AuthInfo.
type inProcessCreds struct {
	credentials.TransportCredentials
}

func (c inProcessCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	if _, ok := conn.(inProcessConn); ok {
		return conn, inProcessAuth{credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity}}, nil
	}
	return c.TransportCredentials.ServerHandshake(conn)
}

func (c inProcessCreds) Clone() credentials.TransportCredentials {
	return inProcessCreds{c.TransportCredentials.Clone()}
}

// inProcessAuth is the AuthInfo of an InProcess connection.
type inProcessAuth struct{ credentials.CommonAuthInfo }

func (inProcessAuth) AuthType() string { return "in-process" }
