package client_test

import (
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemreg/idemreg/client"
)

// TestUnaryInterceptorsRefuseStreamingMethods: a unary interceptor built
// with a streaming method in WithMethods would never see its calls, so a
// keyed call to it would run on every retry; building one fails, naming
// the method. The health service's generated code registers its
// descriptors, Watch streaming and Check unary.
func TestUnaryInterceptorsRefuseStreamingMethods(t *testing.T) {
	c := client.New(nil)
	watch := "/" + grpc_health_v1.Health_ServiceDesc.ServiceName + "/Watch"
	check := "/" + grpc_health_v1.Health_ServiceDesc.ServiceName + "/Check"
	for name, build := range map[string]func(...client.InterceptorOption){
		"server": func(o ...client.InterceptorOption) { client.UnaryServerInterceptor(c, o...) },
		"client": func(o ...client.InterceptorOption) { client.UnaryClientInterceptor(c, o...) },
	} {
		t.Run(name, func(t *testing.T) {
			msg := panicOf(func() { build(client.WithMethods(check, watch)) })
			if !strings.Contains(msg, watch) || !strings.Contains(msg, "server-streaming") {
				t.Fatalf("panic %q: want one naming %s as server-streaming", msg, watch)
			}
			if msg := panicOf(func() { build(client.WithMethods(check, "/unknown.v1.Service/Method")) }); msg != "" {
				t.Fatalf("unary and unknown methods: panic %q", msg)
			}
			if msg := panicOf(func() { build() }); msg != "" {
				t.Fatalf("no WithMethods: panic %q", msg)
			}
		})
	}
	// The stream interceptors take the streaming methods a unary one cannot.
	var _ grpc.StreamServerInterceptor = client.StreamServerInterceptor(c, client.WithMethods(watch))
	var _ grpc.StreamClientInterceptor = client.StreamClientInterceptor(c, client.WithMethods(watch))
}

func panicOf(f func()) (msg string) {
	defer func() {
		if p := recover(); p != nil {
			msg, _ = p.(string)
			if msg == "" {
				msg = "non-string panic"
			}
		}
	}()
	f()
	return ""
}
