// Package client holds the tests of package client
// (github.com/idemreg/idemreg/client) that need a running registry: the
// typed client, Once, OnceBatch and the interceptors against the real
// server over the embedded store, in process (tests/internal/inprocess). They live in the
// tests module so that the client's own module requires no server or
// storage code, which its importers would otherwise find in their module
// graph.
package client
