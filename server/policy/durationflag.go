package policy

import (
	"flag"
	"time"
)

// DurationVar binds a command-line flag of a duration read as the config
// file reads one (ParseDuration: "90s", "1h30m", and days, "7d" or
// "1d12h"), so that every duration an operator writes takes the same
// form; flag.Duration refuses "7d".
func DurationVar(fs *flag.FlagSet, p *time.Duration, name string, value time.Duration, usage string) {
	*p = value
	fs.Var(durationValue{p}, name, usage)
}

// durationValue is the flag.Value of DurationVar.
type durationValue struct{ p *time.Duration }

func (d durationValue) Set(s string) error {
	v, err := ParseDuration(s)
	if err != nil {
		return err
	}
	*d.p = v
	return nil
}

func (d durationValue) String() string {
	if d.p == nil {
		return "0s"
	}
	return FormatDuration(*d.p)
}

// Type names the flag's type for -h.
func (durationValue) Type() string { return "duration" }
