package bench

import (
	"fmt"
	"slices"
	"time"
)

// Summary describes a set of latencies.
type Summary struct {
	N                  int
	Mean               time.Duration
	P50, P95, P99, Max time.Duration
}

// Summarize sorts d and reads its percentiles (nearest rank).
func Summarize(d []time.Duration) Summary {
	if len(d) == 0 {
		return Summary{}
	}
	slices.Sort(d)
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	rank := func(p float64) time.Duration {
		i := int(p*float64(len(d))+0.999999) - 1
		return d[min(max(i, 0), len(d)-1)]
	}
	return Summary{
		N: len(d), Mean: sum / time.Duration(len(d)),
		P50: rank(0.50), P95: rank(0.95), P99: rank(0.99), Max: d[len(d)-1],
	}
}

// String is "p50/p95/p99/max" in milliseconds.
func (s Summary) String() string {
	if s.N == 0 {
		return "-"
	}
	return fmt.Sprintf("%s/%s/%s/%s", ms(s.P50), ms(s.P95), ms(s.P99), ms(s.Max))
}

func ms(d time.Duration) string {
	v := float64(d) / float64(time.Millisecond)
	switch {
	case v < 10:
		return fmt.Sprintf("%.2f", v)
	case v < 100:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.0f", v)
}
