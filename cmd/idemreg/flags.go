package main

import (
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/idemreg/idemreg/server/policy"
)

// serveFlagGroups sorts serve's flags by topic for its -h, in the order an
// operator meets them. A flag of serve's that no group names is printed
// under "Other", and TestServeFlagsAreGrouped fails: add it here.
var serveFlagGroups = []struct {
	title string
	flags []string
}{
	{"Listeners and TLS", []string{"listen", "tls-cert", "tls-key", "tls-client-ca", "plaintext",
		"disable-http-api", "http-api-cors-origins", "health-listen", "disable-reflection"}},
	{"Authentication and the config file", []string{"config", "config-poll", "allow-unauthenticated", "descriptor-set"}},
	{"Store", []string{"database-url", "data-dir", "data-dir-reserve", "sql-batch-size", "sql-batch-window", "sql-batch-slots"}},
	{"Leases and retention (the defaults and bounds --config's policy overrides)", []string{"default-lease", "min-lease", "max-lease",
		"max-lease-total", "default-message-retention", "default-operation-retention", "min-retention", "max-retention", "max-result-bytes"}},
	{"Request limits", []string{"request-timeout", "max-request-timeout", "max-in-flight", "max-in-flight-per-identity",
		"max-calls-per-identity", "max-quota-consumers-per-identity", "quota-refresh", "stream-workers", "refusal-rate", "refusal-delay"}},
	{"Waiting Claims", []string{"max-waiters", "max-waiters-per-identity", "wait-recheck"}},
	{"Replicas (membership, waits across replicas)", []string{"advertise-address", "heartbeat-interval", "member-live-for"}},
	{"Connections", []string{"max-connections", "max-concurrent-streams", "max-pending-calls", "max-public-streams",
		"max-header-list-size", "connection-timeout", "max-connection-age", "max-connection-idle", "max-connecting-per-source",
		"max-health-connections-per-source"}},
	{"Retention sweeper", []string{"sweep-interval", "sweep-batch-size", "sweep-batch-timeout"}},
	{"Health, readiness and shutdown", []string{"readiness-window", "readiness-min-calls", "readiness-max-failure-ratio",
		"drain-delay", "shutdown-timeout"}},
	{"Telemetry and logs", []string{"metrics-listen", "log-level", "log-format", "refusal-log-rate", "parked-count-interval"}},
	{"Operator console", []string{"console-listen", "console-allow-remote", "console-proxy-header", "console-proxy-user", "console-proxy-secret-file", "console-proxy-from"}},
	{"HTTP listeners (metrics, console, pprof, and the HTTP API's side of --listen)", []string{"http-max-connections",
		"http-max-connections-per-source", "http-max-connection-age", "http-read-header-timeout", "http-read-timeout", "http-write-timeout", "http-idle-timeout", "http-max-header-bytes"}},
	{"Profiling", []string{"pprof-listen", "pprof-allow-remote"}},
}

// printFlags prints fs's flags as flag.PrintDefaults does, but for serve by
// topic (serveFlagGroups), and with each type named (a duration flag of
// ours is a flag.Value, which PrintDefaults would call "value").
func printFlags(w io.Writer, fs *flag.FlagSet, grouped bool) {
	if !grouped {
		fs.VisitAll(func(f *flag.Flag) { printFlag(w, f) })
		return
	}
	seen := map[string]bool{}
	for _, g := range serveFlagGroups {
		fmt.Fprintf(w, "\n%s:\n", g.title)
		for _, name := range g.flags {
			if f := fs.Lookup(name); f != nil {
				seen[name] = true
				printFlag(w, f)
			}
		}
	}
	var other []*flag.Flag
	fs.VisitAll(func(f *flag.Flag) {
		if !seen[f.Name] {
			other = append(other, f)
		}
	})
	if len(other) > 0 {
		fmt.Fprint(w, "\nOther:\n")
		for _, f := range other {
			printFlag(w, f)
		}
	}
}

// typed is a flag.Value that names its type for -h.
type typed interface{ Type() string }

func printFlag(w io.Writer, f *flag.Flag) {
	typ, usage := flag.UnquoteUsage(f)
	if t, ok := f.Value.(typed); ok {
		typ = t.Type()
	} else if typ == "value" {
		typ = "string" // flag.TextVar's (--log-level): a word
	}
	var b strings.Builder
	b.WriteString("  -" + f.Name)
	if typ != "" {
		b.WriteString(" " + typ)
	}
	b.WriteString("\n    \t")
	b.WriteString(strings.ReplaceAll(usage, "\n", "\n    \t"))
	switch d := f.DefValue; {
	case d == "", d == "0", d == "0s", d == "false":
	case typ == "string":
		fmt.Fprintf(&b, " (default %q)", d)
	default:
		fmt.Fprintf(&b, " (default %s)", d)
	}
	b.WriteByte('\n')
	fmt.Fprint(w, b.String())
}

// durationVar binds a duration flag read as the config file reads one
// ("7d" included): policy.DurationVar.
var durationVar = policy.DurationVar
