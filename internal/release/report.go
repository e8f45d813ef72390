package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
)

// finding is what the report needs of govulncheck's -format json finding.
type finding struct {
	OSV          string `json:"osv"`
	FixedVersion string `json:"fixed_version"`
	Trace        []struct {
		Module   string `json:"module"`
		Version  string `json:"version"`
		Package  string `json:"package"`
		Function string `json:"function"`
	} `json:"trace"`
}

// vulnReport reads govulncheck's JSON stream and writes one line per
// advisory and module, at the deepest level govulncheck found it (symbol:
// the code calls it; package: imports it; module: requires it). Findings in
// the standard library are the toolchain's that runs the check, not the
// floor's, and are listed apart; any other fails the report.
func vulnReport(r io.Reader, w io.Writer) error {
	type key struct{ osv, module, version, fixed string }
	rank := map[string]int{"module": 0, "package": 1, "symbol": 2}
	level := map[key]string{}
	dec := json.NewDecoder(r)
	for {
		var msg struct {
			Finding *finding `json:"finding"`
		}
		if err := dec.Decode(&msg); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return fmt.Errorf("reading govulncheck's JSON: %w", err)
		}
		f := msg.Finding
		if f == nil || len(f.Trace) == 0 {
			continue
		}
		t := f.Trace[0]
		l := "module"
		switch {
		case t.Function != "":
			l = "symbol"
		case t.Package != "":
			l = "package"
		}
		k := key{f.OSV, t.Module, t.Version, f.FixedVersion}
		if old, ok := level[k]; !ok || rank[l] > rank[old] {
			level[k] = l
		}
	}
	keys := make([]key, 0, len(level))
	for k := range level {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].module != keys[j].module {
			return keys[i].module < keys[j].module
		}
		return keys[i].osv < keys[j].osv
	})
	var failed int
	for _, k := range keys {
		if k.module == "stdlib" {
			fmt.Fprintf(w, "  (the toolchain running this check, not the floor) %s in the standard library %s, fixed in %s: %s\n", k.osv, k.version, k.fixed, level[k])
			continue
		}
		failed++
		fmt.Fprintf(w, "FAIL: %s in %s@%s, fixed in %s: %s\n", k.osv, k.module, k.version, k.fixed, level[k])
	}
	if failed > 0 {
		return fmt.Errorf("%d advisories in required modules (symbol: called; package: imported; module: required)", failed)
	}
	return nil
}
