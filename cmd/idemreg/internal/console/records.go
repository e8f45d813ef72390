package console

import (
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/policy"
)

// Bounds of the records page.
const (
	// DefaultListPageSize is how many records the records page asks
	// ListRecords for when the query does not say.
	DefaultListPageSize = 50
	// maxListPageSize is ListRecords' own bound.
	maxListPageSize = 500
)

// listFilter is the records page's filters, from its query string. Paging
// goes by ListRecords' page tokens, which are valid only with the filters
// they were issued for, so the next-page link carries both.
type listFilter struct {
	Consumer string
	// Exact matches Consumer exactly, else it is the start of the names of
	// the consumers listed ("" lists every consumer the identity
	// administers).
	Exact bool
	// State is the state listed; STATE_UNSPECIFIED lists every state.
	State      idemregv1.State
	MinAttempt int64
	OlderThan  time.Duration
	Size       int
	// Held leaves out the records in progress that nobody holds
	// (awaitingClaim): invalidated or released, and not claimed since.
	// ListRecords cannot tell them apart, so the console drops them from
	// each page it reads.
	Held bool
}

// listStates are the states the filter offers, as query values.
var listStates = []idemregv1.State{idemregv1.State_STATE_PARKED, idemregv1.State_STATE_IN_PROGRESS, idemregv1.State_STATE_COMPLETED}

// parseListFilter reads the filters of a records page's query. With no
// query at all it lists every parked record the identity may see.
func parseListFilter(q url.Values) (listFilter, error) {
	f := listFilter{Consumer: q.Get("consumer"), Exact: q.Get("match") == "exact", State: idemregv1.State_STATE_PARKED, Size: DefaultListPageSize}
	var errs []error
	switch s := q.Get("state"); s {
	case "":
	case "any":
		f.State = idemregv1.State_STATE_UNSPECIFIED
	default:
		v, ok := idemregv1.State_value[s]
		if !ok || v == 0 {
			errs = append(errs, fmt.Errorf("state %q is not one the list offers", s))
		} else {
			f.State = idemregv1.State(v)
		}
	}
	if f.Exact && f.Consumer == "" {
		errs = append(errs, errors.New("give a consumer to match exactly, or match by prefix"))
	}
	if s := strings.TrimSpace(q.Get("min_attempt")); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 0 {
			errs = append(errs, fmt.Errorf("min attempt must be a whole number, 0 or more, got %q", s))
		}
		f.MinAttempt = n
	}
	if s := strings.TrimSpace(q.Get("older_than")); s != "" {
		d, err := policy.ParseDuration(s)
		if err != nil || d < 0 {
			errs = append(errs, fmt.Errorf("older than must be a duration such as 90s, 15m, 2h or 7d, got %q", s))
		}
		f.OlderThan = d
	}
	f.Held = q.Get("held") == "1"
	if s := q.Get("size"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > maxListPageSize {
			errs = append(errs, fmt.Errorf("page size must be 1-%d, got %q", maxListPageSize, s))
		} else {
			f.Size = n
		}
	}
	return f, errors.Join(errs...)
}

// query is f as a records page query, with the page token page if any.
func (f listFilter) query(page string) url.Values {
	q := url.Values{"consumer": {f.Consumer}, "match": {"prefix"}, "state": {"any"}}
	if f.Exact {
		q.Set("match", "exact")
	}
	if f.State != idemregv1.State_STATE_UNSPECIFIED {
		q.Set("state", f.State.String())
	}
	if f.MinAttempt > 0 {
		q.Set("min_attempt", strconv.FormatInt(f.MinAttempt, 10))
	}
	if f.OlderThan > 0 {
		q.Set("older_than", f.OlderThan.String())
	}
	if f.Size > 0 && f.Size != DefaultListPageSize {
		q.Set("size", strconv.Itoa(f.Size))
	}
	if f.Held {
		q.Set("held", "1")
	}
	if page != "" {
		q.Set("page", page)
	}
	return q
}

// link is the records page of f at page ("" for the first).
func (f listFilter) link(page string) template.URL {
	return template.URL("/records?" + f.query(page).Encode())
}

// StateName is the filter's state as the form's select names it.
func (f listFilter) StateName() string {
	if f.State == idemregv1.State_STATE_UNSPECIFIED {
		return "any"
	}
	return f.State.String()
}

// stateChoice is a choice of the form's state select.
type stateChoice struct{ Value, Label string }

// States are the form's choices of state.
func (f listFilter) States() []stateChoice {
	out := make([]stateChoice, 0, len(listStates)+1)
	for _, s := range listStates {
		out = append(out, stateChoice{s.String(), stateNames[s]})
	}
	return append(out, stateChoice{"any", "any"})
}

// MinAttemptText and OlderThanText are the form's values: empty for none.
func (f listFilter) MinAttemptText() string {
	if f.MinAttempt <= 0 {
		return ""
	}
	return strconv.FormatInt(f.MinAttempt, 10)
}

func (f listFilter) OlderThanText() string {
	if f.OlderThan <= 0 {
		return ""
	}
	return f.OlderThan.String()
}

func (f listFilter) request(page string) *idemregv1.ListRecordsRequest {
	req := &idemregv1.ListRecordsRequest{
		Consumer: f.Consumer, ConsumerPrefix: !f.Exact, State: f.State, MinAttempt: f.MinAttempt,
		PageSize: int32(f.Size), PageToken: page,
	}
	if f.OlderThan > 0 {
		req.OlderThan = durationpb.New(f.OlderThan)
	}
	return req
}

// recordsView is the records page.
type recordsView struct {
	Filter listFilter
	Listed bool // the page was read (no error)
	// Here is this page's link, for the bulk pages to lead back to.
	Here string
	Rows []listedRow
	// Unheld counts the records of the page left out by Filter.Held.
	Unheld    int
	StoreTime timeView
	Next      template.URL // the next page, if any
	First     template.URL // the first page, when this is a later one
	// Presets are the usual questions, as links.
	Parked, Stuck template.URL
	// StuckAfter is Config.StuckAfter, for the preset's label.
	StuckAfter string
}

// listedRow is one record of the records page.
type listedRow struct {
	Key        recordKey
	Token      int64
	State      string
	Attempt    int64
	Holder     string
	ParkReason string
	Age        string
	Created    timeView
	Lease      string
	// Earlier is how many earlier attempts the record keeps, LastEnd how
	// the last of them ended.
	Earlier int
	LastEnd string
}

func (c *Console) records(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.page(s)
	q := r.URL.Query()
	f, err := parseListFilter(q)
	view := recordsView{
		Filter: f,
		Parked: listFilter{State: idemregv1.State_STATE_PARKED, Size: DefaultListPageSize}.link(""),
		// Stuck: held (attempt 1 or more) for long. A record nobody holds
		// (attempt 0: invalidated or released, waiting for its next
		// Claim) is not stuck, however long ago it was first claimed.
		Stuck:      listFilter{State: idemregv1.State_STATE_IN_PROGRESS, MinAttempt: 1, Held: true, OlderThan: c.cfg.StuckAfter, Size: DefaultListPageSize}.link(""),
		StuckAfter: strings.TrimSuffix(strings.TrimSuffix(fmtDuration(c.cfg.StuckAfter), "0s"), "0m"),
	}
	if err != nil {
		p.Data, p.Error = view, "Invalid filter: "+err.Error()
		c.render(w, http.StatusBadRequest, "records.html", p)
		return
	}
	page := q.Get("page")
	if page != "" {
		view.First = f.link("")
	}
	ctx, cancel := c.callContext(r.Context(), s)
	defer cancel()
	res, err := c.admin.ListRecords(ctx, f.request(page))
	if err != nil {
		code, msg := explain(err)
		p.Data, p.Error = view, msg
		c.render(w, code, "records.html", p)
		return
	}
	view.Listed = true
	view.Here = r.URL.RequestURI()
	now := res.GetStoreTime().AsTime()
	view.StoreTime = when(time.Time{}, res.GetStoreTime())
	for _, lr := range res.GetRecords() {
		if f.Held && awaitingClaim(lr.GetRecord(), lr.GetHistory()) != idemregv1.AttemptEnd_ATTEMPT_END_UNSPECIFIED {
			view.Unheld++
			continue
		}
		view.Rows = append(view.Rows, listRow(now, lr))
	}
	if next := res.GetNextPageToken(); next != "" {
		view.Next = f.link(next)
	}
	p.Data = view
	c.render(w, http.StatusOK, "records.html", p)
}

func listRow(now time.Time, lr *idemregv1.ListedRecord) listedRow {
	rec := lr.GetRecord()
	row := listedRow{
		Key:   recordKey{Consumer: rec.GetConsumer(), Kind: rec.GetKind(), Key: rec.GetKey()},
		Token: rec.GetToken(),
		State: stateLabel(rec, lr.GetHistory()), Attempt: rec.GetAttempt(), Holder: rec.GetHolder(),
		ParkReason: rec.GetParkReason(), Age: since(now, rec.GetCreatedAt()), Created: when(now, rec.GetCreatedAt()),
		Earlier: len(lr.GetHistory()),
	}
	if h := lr.GetHistory(); len(h) > 0 {
		row.LastEnd = attemptEnd(h[len(h)-1].GetEnd())
	}
	if rec.GetState() == idemregv1.State_STATE_IN_PROGRESS && awaitingClaim(rec, lr.GetHistory()) == idemregv1.AttemptEnd_ATTEMPT_END_UNSPECIFIED && rec.GetLeaseExpiresAt() != nil {
		if ends := rec.GetLeaseExpiresAt().AsTime(); ends.After(now) {
			row.Lease = "live, " + fmtDuration(ends.Sub(now)) + " left"
		} else {
			row.Lease = "ended " + fmtDuration(now.Sub(ends)) + " ago"
		}
	}
	return row
}

// since is how long before now ts was, for a person.
func since(now time.Time, ts *timestamppb.Timestamp) string {
	if ts == nil {
		return ""
	}
	return fmtDuration(now.Sub(ts.AsTime()))
}

// fmtDuration is d to the second, with days past two of them.
func fmtDuration(d time.Duration) string {
	if d < time.Second {
		return "0s"
	}
	d = d.Round(time.Second)
	if d < 48*time.Hour {
		return d.String()
	}
	days := d / (24 * time.Hour)
	return fmt.Sprintf("%dd%s", days, (d - days*24*time.Hour).String())
}
