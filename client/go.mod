module github.com/idemreg/idemreg/client

go 1.24.0

require (
	github.com/idemreg/idemreg/proto v0.0.0-00010101000000-000000000000
	google.golang.org/genproto/googleapis/rpc v0.0.0-20240318140521-94a12d6c2237
	google.golang.org/grpc v1.64.1
	google.golang.org/protobuf v1.36.12
)

require (
	golang.org/x/net v0.26.0 // indirect
	golang.org/x/sys v0.21.0 // indirect
	golang.org/x/text v0.16.0 // indirect
)

// Until the API's module is published, this checkout provides it. A
// replace applies only where its go.mod is the main module: a service that
// imports the client before then needs the same line in its own go.mod.
replace github.com/idemreg/idemreg/proto => ../proto
