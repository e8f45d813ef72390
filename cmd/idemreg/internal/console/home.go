package console

import (
	"context"
	"html/template"
	"net/http"
	"slices"
	"strings"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

func (c *Console) page(s *session) page {
	// A proxy's sign-in has no sign-out: the proxy signs the next request
	// in again.
	return page{Identity: s.identity, CSRF: s.csrf, SignIn: c.cfg.SignIn != nil && !s.viaProxy}
}

// statusPanel is the home page's view of the server.
type statusPanel struct {
	Store string // SERVING, NOT_SERVING, or the error
	// Lag is the sweeper's lag as the panel says it.
	Lag string
	// Parked is the count of parked records per consumer the identity
	// administers, by name; ParkedError says why it is missing.
	Parked      []parkedCount
	ParkedTotal int64
	ParkedError string
}

// parkedCount is one consumer's line of the status panel.
type parkedCount struct {
	Consumer string
	Count    int64
}

// Link is the records page listing the consumer's parked records.
func (p parkedCount) Link() template.URL {
	return listFilter{Consumer: p.Consumer, Exact: true, State: idemregv1.State_STATE_PARKED}.link("")
}

func (c *Console) home(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.page(s)
	ctx, cancel := c.callContext(r.Context(), s)
	defer cancel()
	panel := statusPanel{}
	if res, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		panel.Store = "unknown: " + status.Convert(err).Message()
	} else {
		panel.Store = res.GetStatus().String()
	}
	panel.Lag = c.sweepLag(ctx)
	if res, err := c.admin.CountParked(ctx, &idemregv1.CountParkedRequest{}); err != nil {
		_, panel.ParkedError = explain(err)
	} else {
		for consumer, n := range res.GetParked() {
			panel.Parked = append(panel.Parked, parkedCount{Consumer: consumer, Count: n})
			panel.ParkedTotal += n
		}
		slices.SortFunc(panel.Parked, func(a, b parkedCount) int { return strings.Compare(a.Consumer, b.Consumer) })
	}
	p.Data = panel
	c.render(w, http.StatusOK, "home.html", p)
}

// ExpiryReader is the method of storage.Sweeper that SweepLagFrom reads;
// the console names it here rather than import the storage package.
type ExpiryReader interface {
	OldestExpiry(ctx context.Context) (oldest, now time.Time, ok bool, err error)
}

// SweepLagFrom is a Config.SweepLag that reads a store's oldest expiry: the
// lag is how long before the store's clock the oldest stored record
// expired, zero when it has not yet.
func SweepLagFrom(store ExpiryReader) func(context.Context) (time.Duration, bool, error) {
	return func(ctx context.Context) (time.Duration, bool, error) {
		oldest, now, ok, err := store.OldestExpiry(ctx)
		if err != nil || !ok {
			return 0, false, err
		}
		return max(now.Sub(oldest), 0), true, nil
	}
}

// sweepLag is the status panel's line about the sweeper.
func (c *Console) sweepLag(ctx context.Context) string {
	if c.cfg.SweepLag == nil {
		return "not available: this server's store does not report it"
	}
	lag, ok, err := c.cfg.SweepLag(ctx)
	switch {
	case err != nil:
		// The store's error may quote its driver: it goes to the log only.
		c.cfg.Logger.Warn("console sweep lag failed", "error", err)
		return "unknown: the store did not answer (the server's log has the error)"
	case !ok:
		return "none: the store holds no record"
	case lag <= 0:
		return "none: no stored record has expired yet"
	default:
		return fmtDuration(lag) + ": the oldest expired record has waited this long to be deleted"
	}
}
