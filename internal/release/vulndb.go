package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/mod/semver"
)

// entry is what the index needs of an OSV entry; the entry itself is copied
// byte for byte.
type entry struct {
	ID       string    `json:"id"`
	Modified time.Time `json:"modified"`
	Affected []struct {
		Package struct {
			Name      string `json:"name"`
			Ecosystem string `json:"ecosystem"`
		} `json:"package"`
		Ranges []struct {
			Type   string `json:"type"`
			Events []struct {
				Introduced string `json:"introduced,omitempty"`
				Fixed      string `json:"fixed,omitempty"`
			} `json:"events"`
		} `json:"ranges"`
	} `json:"affected"`
}

// The v1 index (https://go.dev/security/vuln/database#api), as
// golang.org/x/vuln/internal/client reads it.
type (
	dbMeta struct {
		Modified time.Time `json:"modified"`
	}
	moduleMeta struct {
		Path  string       `json:"path"`
		Vulns []moduleVuln `json:"vulns"`
	}
	moduleVuln struct {
		ID       string    `json:"id"`
		Modified time.Time `json:"modified"`
		Fixed    string    `json:"fixed,omitempty"`
	}
)

// buildVulnDB writes the v1 database for the OSV entries in osvDir to out.
func buildVulnDB(osvDir, out string) (int, error) {
	names, err := filepath.Glob(filepath.Join(osvDir, "*.json"))
	if err != nil {
		return 0, err
	}
	if len(names) == 0 {
		return 0, fmt.Errorf("%s: no OSV entries (*.json)", osvDir)
	}
	if err := os.RemoveAll(out); err != nil {
		return 0, err
	}
	for _, d := range []string{"ID", "index"} {
		if err := os.MkdirAll(filepath.Join(out, d), 0o755); err != nil {
			return 0, err
		}
	}
	var db dbMeta
	modules := map[string]*moduleMeta{}
	for _, name := range names {
		data, err := os.ReadFile(name)
		if err != nil {
			return 0, err
		}
		var e entry
		if err := json.Unmarshal(data, &e); err != nil {
			return 0, fmt.Errorf("%s: %w", name, err)
		}
		if filepath.Base(name) != e.ID+".json" {
			return 0, fmt.Errorf("%s: the entry's id is %q: want files named <id>.json", name, e.ID)
		}
		if e.Modified.After(db.Modified) {
			db.Modified = e.Modified
		}
		for _, a := range e.Affected {
			m := modules[a.Package.Name]
			if m == nil {
				m = &moduleMeta{Path: a.Package.Name, Vulns: []moduleVuln{}}
				modules[a.Package.Name] = m
			}
			m.Vulns = append(m.Vulns, moduleVuln{ID: e.ID, Modified: e.Modified, Fixed: latestFix(a.Ranges)})
		}
		if err := os.WriteFile(filepath.Join(out, "ID", e.ID+".json"), data, 0o644); err != nil {
			return 0, err
		}
	}
	list := make([]*moduleMeta, 0, len(modules))
	for _, m := range modules {
		sort.Slice(m.Vulns, func(i, j int) bool { return m.Vulns[i].ID < m.Vulns[j].ID })
		list = append(list, m)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].Path < list[j].Path })
	for name, v := range map[string]any{"db.json": db, "modules.json": list} {
		data, err := json.Marshal(v)
		if err != nil {
			return 0, err
		}
		if err := os.WriteFile(filepath.Join(out, "index", name), data, 0o644); err != nil {
			return 0, err
		}
	}
	return len(names), nil
}

// latestFix is the index's "fixed": the latest fixed version of the
// SEMVER ranges, or none if the vulnerability was introduced again after
// it (golang.org/x/vuln's semver.NonSupersededFix).
func latestFix(ranges []struct {
	Type   string `json:"type"`
	Events []struct {
		Introduced string `json:"introduced,omitempty"`
		Fixed      string `json:"fixed,omitempty"`
	} `json:"events"`
}) string {
	var latest string
	for _, r := range ranges {
		if r.Type != "SEMVER" {
			continue
		}
		for _, e := range r.Events {
			if e.Fixed != "" && less(latest, e.Fixed) {
				latest = e.Fixed
			}
		}
		for _, e := range r.Events {
			if e.Introduced != "" && e.Introduced != "0" && less(latest, e.Introduced) {
				latest = ""
				break
			}
		}
	}
	return latest
}

// less compares OSV versions, which have no leading "v"; an empty or
// invalid version sorts first.
func less(a, b string) bool {
	return semver.Compare(canonical(a), canonical(b)) < 0
}

func canonical(v string) string {
	if v == "" {
		return ""
	}
	if !strings.HasPrefix(v, "v") {
		v = "v" + v
	}
	return v
}
