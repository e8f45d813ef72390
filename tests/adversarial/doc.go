// Package adversarial attacks a real `idemreg serve` on loopback, the way
// a hostile peer or a hostile tenant would, and checks the bound the
// threat model (docs/operations.md, "Threat model and limits") states for
// each attack: malformed frames, header bombs, slowloris, forged claim
// secrets and page tokens, cross-tenant calls, and the findings of issue
// 25. While an attack runs a neighbour (another tenant) runs a bounded
// loop of Claims and Completes; afterwards every Complete it was told
// succeeded must replay, and its throughput must keep a stated fraction of
// what it had alone.
//
// Everything it opens is on 127.0.0.1, every loop is bounded in count and
// time, and the whole suite stops by itself in about two minutes:
//
//	make adversarial   # cd tests && go test -count=1 -timeout 10m ./adversarial/ -v
//
// docs/testing.md ("Adversarial suite") lists the cases and their bounds.
package adversarial
