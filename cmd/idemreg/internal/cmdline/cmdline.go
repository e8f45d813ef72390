// Package cmdline is idemreg's command line: every flag declared once, as
// a Flag (its name, its group in -h, its help and what it sets), so that
// no second list of the flags has to be kept in step with the first; its
// environment variable derived from its name (EnvName), so that the two
// cannot drift either; the environment read before the arguments, so that
// a flag given wins (Parse); and -h printed in the table's groups and
// order, each flag's type named (Print).
package cmdline

import (
	"encoding"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/idemreg/idemreg/server/policy"
)

// Flag is one flag of a command, declared once. The value its variable
// holds when it is bound is its default.
type Flag struct {
	Name string
	// Group is the topic -h prints the flag under in a grouped help
	// (serve's); see Group.
	Group string
	Usage string
	bind  func(fs *flag.FlagSet, name, usage string)
}

// Group gives flags the group title, for a help printed by topic.
func Group(title string, flags ...Flag) []Flag {
	for i := range flags {
		flags[i].Group = title
	}
	return flags
}

// Bind binds flags on fs, in order.
func Bind(fs *flag.FlagSet, flags ...Flag) {
	for _, f := range flags {
		f.bind(fs, f.Name, f.Usage)
	}
}

// String is a flag of a string.
func String(p *string, name, usage string) Flag {
	return Flag{Name: name, Usage: usage, bind: func(fs *flag.FlagSet, name, usage string) { fs.StringVar(p, name, *p, usage) }}
}

// Bool is a flag of a bool.
func Bool(p *bool, name, usage string) Flag {
	return Flag{Name: name, Usage: usage, bind: func(fs *flag.FlagSet, name, usage string) { fs.BoolVar(p, name, *p, usage) }}
}

// Int is a flag of an int.
func Int(p *int, name, usage string) Flag {
	return Flag{Name: name, Usage: usage, bind: func(fs *flag.FlagSet, name, usage string) { fs.IntVar(p, name, *p, usage) }}
}

// Int64 is a flag of an int64.
func Int64(p *int64, name, usage string) Flag {
	return Flag{Name: name, Usage: usage, bind: func(fs *flag.FlagSet, name, usage string) { fs.Int64Var(p, name, *p, usage) }}
}

// Float64 is a flag of a float64.
func Float64(p *float64, name, usage string) Flag {
	return Flag{Name: name, Usage: usage, bind: func(fs *flag.FlagSet, name, usage string) { fs.Float64Var(p, name, *p, usage) }}
}

// Text is a flag of a value that reads and writes itself as text (a
// slog.Level); -h calls its type "string".
func Text(p interface {
	encoding.TextMarshaler
	encoding.TextUnmarshaler
}, name, usage string) Flag {
	return Flag{Name: name, Usage: usage, bind: func(fs *flag.FlagSet, name, usage string) { fs.TextVar(p, name, p, usage) }}
}

// Duration is a flag of a duration read as the config file reads one
// ("7d" included: policy.DurationVar); flag.Duration would refuse days.
func Duration(p *time.Duration, name, usage string) Flag {
	return Flag{Name: name, Usage: usage, bind: func(fs *flag.FlagSet, name, usage string) { policy.DurationVar(fs, p, name, *p, usage) }}
}

// Uint32 is a flag of a uint32 (grpc's bounds).
func Uint32(p *uint32, name, usage string) Flag {
	return Var(uint32Value{p}, name, usage)
}

// OffAtZero is a flag whose 0 turns something off, of a library field
// where zero takes the default and a negative value turns it off.
func OffAtZero[T int | time.Duration](p *T, parse func(string) (T, error), name, usage string) Flag {
	return Var(offAtZero[T]{p, parse, name}, name, usage)
}

// Var is a flag of a flag.Value of its own; one that has a Type method
// names its type in -h.
func Var(v flag.Value, name, usage string) Flag {
	return Flag{Name: name, Usage: usage, bind: func(fs *flag.FlagSet, name, usage string) { fs.Var(v, name, usage) }}
}

// EnvName is the environment variable of a flag: --database-url is
// IDEMREG_DATABASE_URL.
func EnvName(flag string) string {
	return "IDEMREG_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// NameEnv ends each flag's help with its environment variable, as -h
// shows it.
func NameEnv(fs *flag.FlagSet) {
	fs.VisitAll(func(f *flag.Flag) { f.Usage += " ($" + EnvName(f.Name) + ")" })
}

// Parse reads environment variables first, then args, so flags win.
func Parse(fs *flag.FlagSet, args []string) error {
	var envErr error
	fs.VisitAll(func(f *flag.Flag) {
		if v, ok := os.LookupEnv(EnvName(f.Name)); ok {
			if err := f.Value.Set(v); err != nil {
				envErr = errors.Join(envErr, fmt.Errorf("%s: %w", EnvName(f.Name), err))
			}
		}
	})
	if envErr != nil {
		return envErr
	}
	return fs.Parse(args)
}

// offAtZero is the flag.Value of OffAtZero.
type offAtZero[T int | time.Duration] struct {
	p     *T
	parse func(string) (T, error)
	name  string
}

func (o offAtZero[T]) Set(s string) error {
	v, err := o.parse(s)
	switch {
	case err != nil:
		return err
	case v < 0:
		return fmt.Errorf("--%s must not be negative (0 turns it off)", o.name)
	case v == 0:
		v = -1
	}
	*o.p = v
	return nil
}

func (o offAtZero[T]) Type() string {
	if _, ok := any(*new(T)).(time.Duration); ok {
		return "duration"
	}
	return "int"
}

func (o offAtZero[T]) String() string {
	if o.p == nil || *o.p < 0 {
		return "0"
	}
	if d, ok := any(*o.p).(time.Duration); ok {
		return policy.FormatDuration(d)
	}
	return fmt.Sprint(*o.p)
}

// uint32Value is the flag.Value of Uint32.
type uint32Value struct{ p *uint32 }

func (u uint32Value) Set(s string) error {
	n, err := strconv.ParseUint(s, 10, 32)
	*u.p = uint32(n)
	return err
}

func (uint32Value) Type() string { return "uint" }

func (u uint32Value) String() string {
	if u.p == nil {
		return "0"
	}
	return strconv.FormatUint(uint64(*u.p), 10)
}

// Typed is a flag.Value that names its type for -h.
type Typed interface{ Type() string }

// Print prints fs's flags as flag.PrintDefaults does, but with each type
// named (a duration flag of ours is a flag.Value, which PrintDefaults
// would call "value"); by table's groups, in its order, when table is not
// nil, with a flag it does not declare under "Other" at the end; else in
// name order.
func Print(w io.Writer, fs *flag.FlagSet, table []Flag) {
	if table == nil {
		fs.VisitAll(func(f *flag.Flag) { printFlag(w, f) })
		return
	}
	seen := map[string]bool{}
	for i, d := range table {
		if i == 0 || d.Group != table[i-1].Group {
			fmt.Fprintf(w, "\n%s:\n", d.Group)
		}
		if f := fs.Lookup(d.Name); f != nil {
			seen[d.Name] = true
			printFlag(w, f)
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

func printFlag(w io.Writer, f *flag.Flag) {
	typ, usage := flag.UnquoteUsage(f)
	if t, ok := f.Value.(Typed); ok {
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
