package bench

import (
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strings"
	"time"
)

// Point is one run of a series: its callers, its pair latency percentiles
// and its throughput.
type Point struct {
	Callers  int
	P50, P99 time.Duration
	PairsPS  float64
}

// Series is one target's runs, by callers.
type Series struct {
	Name   string
	Points []Point
}

var palette = []string{"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"}

// WriteChart draws two panels as SVG: the claim+complete pair latency (p50
// dashed, p99 solid, log scale) and the throughput, both against callers
// (log scale), one colour per series.
func WriteChart(w io.Writer, title string, series []Series) error {
	const (
		panelW, panelH = 460, 320
		left, top      = 70, 50
		gap            = 90
		width          = left + 2*panelW + gap + 30
		height         = top + panelH + 80
	)
	var callers []int
	var latMin, latMax, tpMax float64 = math.Inf(1), 0, 0
	for _, s := range series {
		for _, p := range s.Points {
			if !slices.Contains(callers, p.Callers) {
				callers = append(callers, p.Callers)
			}
			for _, d := range []time.Duration{p.P50, p.P99} {
				v := float64(d) / float64(time.Millisecond)
				latMin, latMax = math.Min(latMin, v), math.Max(latMax, v)
			}
			tpMax = math.Max(tpMax, p.PairsPS)
		}
	}
	if len(callers) == 0 {
		return fmt.Errorf("chart: no points")
	}
	slices.Sort(callers)
	latLo := math.Pow(10, math.Floor(math.Log10(math.Max(latMin, 0.01))))
	latHi := math.Pow(10, math.Ceil(math.Log10(math.Max(latMax, latLo*10))))
	tpHi := niceCeil(tpMax)
	cLo, cHi := math.Log2(float64(callers[0])), math.Log2(float64(callers[len(callers)-1]))
	if cHi == cLo {
		cHi = cLo + 1
	}
	xOf := func(x0 float64, c int) float64 {
		return x0 + (math.Log2(float64(c))-cLo)/(cHi-cLo)*panelW
	}
	yLat := func(d time.Duration) float64 {
		v := math.Max(float64(d)/float64(time.Millisecond), latLo)
		return top + panelH - (math.Log10(v)-math.Log10(latLo))/(math.Log10(latHi)-math.Log10(latLo))*panelH
	}
	yTP := func(v float64) float64 { return top + panelH - v/tpHi*panelH }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="24" font-size="15" font-weight="bold">%s</text>`+"\n", left, html.EscapeString(title))
	panels := []struct {
		x0     float64
		label  string
		yTicks []float64
		yOf    func(float64) float64
		tick   func(float64) string
	}{
		{left, "claim+complete latency, ms (p50 dashed, p99 solid)", logTicks(latLo, latHi),
			func(v float64) float64 { return yLat(time.Duration(v * float64(time.Millisecond))) },
			func(v float64) string { return trimFloat(v) }},
		{left + panelW + gap, "throughput, claim+complete pairs/s", linTicks(tpHi),
			yTP, func(v float64) string { return fmt.Sprintf("%.0f", v) }},
	}
	for _, p := range panels {
		fmt.Fprintf(&b, `<rect x="%.0f" y="%d" width="%d" height="%d" fill="none" stroke="#444"/>`+"\n", p.x0, top, panelW, panelH)
		fmt.Fprintf(&b, `<text x="%.0f" y="%d">%s</text>`+"\n", p.x0, top-8, html.EscapeString(p.label))
		for _, v := range p.yTicks {
			y := p.yOf(v)
			fmt.Fprintf(&b, `<line x1="%.0f" x2="%.0f" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", p.x0, p.x0+panelW, y, y)
			fmt.Fprintf(&b, `<text x="%.0f" y="%.1f" text-anchor="end">%s</text>`+"\n", p.x0-6, y+4, p.tick(v))
		}
		for _, c := range callers {
			x := xOf(p.x0, c)
			fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#ddd"/>`+"\n", x, x, top, top+panelH)
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%d</text>`+"\n", x, top+panelH+16, c)
		}
		fmt.Fprintf(&b, `<text x="%.0f" y="%d" text-anchor="middle">concurrent callers</text>`+"\n", p.x0+panelW/2, top+panelH+34)
	}
	legendX := float64(left)
	for i, s := range series {
		color := palette[i%len(palette)]
		pts := slices.Clone(s.Points)
		slices.SortFunc(pts, func(a, b Point) int { return a.Callers - b.Callers })
		var p50, p99, tp []string
		for _, p := range pts {
			p50 = append(p50, fmt.Sprintf("%.1f,%.1f", xOf(panels[0].x0, p.Callers), yLat(p.P50)))
			p99 = append(p99, fmt.Sprintf("%.1f,%.1f", xOf(panels[0].x0, p.Callers), yLat(p.P99)))
			tp = append(tp, fmt.Sprintf("%.1f,%.1f", xOf(panels[1].x0, p.Callers), yTP(p.PairsPS)))
		}
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2" stroke-dasharray="5,4"/>`+"\n", strings.Join(p50, " "), color)
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n", strings.Join(p99, " "), color)
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n", strings.Join(tp, " "), color)
		for _, p := range pts {
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", xOf(panels[1].x0, p.Callers), yTP(p.PairsPS), color)
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", xOf(panels[0].x0, p.Callers), yLat(p.P99), color)
		}
		lx := legendX
		legendX += 50 + 7*float64(len(s.Name))
		ly := float64(top + panelH + 62)
		fmt.Fprintf(&b, `<line x1="%.0f" x2="%.0f" y1="%.0f" y2="%.0f" stroke="%s" stroke-width="3"/>`+"\n", lx, lx+24, ly, ly, color)
		fmt.Fprintf(&b, `<text x="%.0f" y="%.0f">%s</text>`+"\n", lx+30, ly+4, html.EscapeString(s.Name))
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func logTicks(lo, hi float64) []float64 {
	var out []float64
	for v := lo; v <= hi*1.0001; v *= 10 {
		out = append(out, v)
	}
	return out
}

func linTicks(hi float64) []float64 {
	var out []float64
	for i := 0; i <= 5; i++ {
		out = append(out, hi*float64(i)/5)
	}
	return out
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func trimFloat(v float64) string {
	s := fmt.Sprintf("%.3f", v)
	s = strings.TrimRight(s, "0")
	return strings.TrimSuffix(s, ".")
}
