package server_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alphapb "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/servertest"
	"github.com/idemreg/idemreg/storage/pebble"
)

// TestReflectionDescribesEveryService does what `grpcurl list`, `grpcurl
// describe` and `buf curl --list-methods` do against a real server: list
// the services through reflection (v1, and v1alpha, which older tools
// still ask), then fetch the file of each and describe it from the files
// reflection sent alone. Every service listed must be described, with its
// methods: the replicas' internal service (idemreg.internal.*) has no
// descriptor to send, so listing it failed `buf curl --list-methods` as a
// whole; it is not listed, though it is served.
func TestReflectionDescribesEveryService(t *testing.T) {
	store, err := pebble.Open("", pebble.WithInMemory())
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	addr, srv := servertest.Serve(t, store, server.Config{})
	require.Contains(t, srv.GRPCServer().GetServiceInfo(), "idemreg.internal.peers.v1.Peers", "the internal service is served")
	conn := servertest.Dial(t, addr)

	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(t.Context())
	require.NoError(t, err)
	ask := func(req *reflectionpb.ServerReflectionRequest) *reflectionpb.ServerReflectionResponse {
		t.Helper()
		require.NoError(t, stream.Send(req))
		res, err := stream.Recv()
		require.NoError(t, err)
		require.Nil(t, res.GetErrorResponse(), "reflection answered an error to %v", req)
		return res
	}
	var names []string
	for _, s := range ask(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{},
	}).GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	require.ElementsMatch(t, []string{
		"idemreg.v1.RegistryService", "idemreg.v1.AdminService", "grpc.health.v1.Health",
		"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection",
	}, names)

	// Each file as reflection sends it, with the ones it imports that
	// this stream has not sent yet.
	sent := map[string]*descriptorpb.FileDescriptorProto{}
	for _, name := range names {
		res := ask(&reflectionpb.ServerReflectionRequest{
			MessageRequest: &reflectionpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: name},
		})
		for _, b := range res.GetFileDescriptorResponse().GetFileDescriptorProto() {
			fd := &descriptorpb.FileDescriptorProto{}
			require.NoError(t, proto.Unmarshal(b, fd))
			sent[fd.GetName()] = fd
		}
	}
	set := &descriptorpb.FileDescriptorSet{}
	for _, fd := range sent {
		set.File = append(set.File, fd)
	}
	files, err := protodesc.NewFiles(set) // fails if a file's import was never sent
	require.NoError(t, err)
	for _, name := range names {
		d, err := files.FindDescriptorByName(protoreflect.FullName(name))
		require.NoError(t, err, "reflection describes %s", name)
		sd, ok := d.(protoreflect.ServiceDescriptor)
		require.True(t, ok, "%s is a service", name)
		require.Positive(t, sd.Methods().Len(), "%s has methods", name)
		if name == "idemreg.v1.RegistryService" {
			want, err := protoregistry.GlobalFiles.FindDescriptorByName("idemreg.v1.RegistryService")
			require.NoError(t, err)
			require.Equal(t, want.(protoreflect.ServiceDescriptor).Methods().Len(), sd.Methods().Len())
		}
	}

	// The v1alpha service lists the same.
	alpha, err := reflectionv1alphapb.NewServerReflectionClient(conn).ServerReflectionInfo(t.Context())
	require.NoError(t, err)
	require.NoError(t, alpha.Send(&reflectionv1alphapb.ServerReflectionRequest{
		MessageRequest: &reflectionv1alphapb.ServerReflectionRequest_ListServices{},
	}))
	res, err := alpha.Recv()
	require.NoError(t, err)
	var alphaNames []string
	for _, s := range res.GetListServicesResponse().GetService() {
		alphaNames = append(alphaNames, s.GetName())
	}
	require.ElementsMatch(t, names, alphaNames)
}
