// Package faults holds the system tests that run the real `idemreg serve`
// binary and break what is around it: a SIGKILL in the middle of writes on
// the embedded store (with every go test), the linearizability checks under
// SIGKILL, PostgreSQL crashes and network faults (build tag
// linearizability), and the exactly-once run of the ledger example under
// chaos (build tag chaos). The binary is built from the root module; the
// harnesses they use are tests/lincheck and tests/pgcluster.
// docs/testing.md says how to run them and what they found.
package faults
