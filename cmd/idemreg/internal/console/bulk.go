package console

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// Bounds of a bulk action.
const (
	// maxBulkRecords is the most records one bulk action acts on: a
	// records page's worth at the default size and then some, with each
	// record its own call.
	maxBulkRecords = 100
	// maxBulkFormBytes bounds the body of POST /bulk: maxBulkRecords
	// selections of the longest consumer and key, URL-encoded twice.
	maxBulkFormBytes = 1 << 20
)

// The bulk actions.
const (
	bulkRelease    = "release"
	bulkInvalidate = "invalidate"
)

// bulkTarget is one selected record: its key and the token the operator
// saw, so that a record changed since is refused, as a single action's is.
type bulkTarget struct {
	Key   recordKey
	Token int64
}

// Value is the target as a checkbox's value.
func (b bulkTarget) Value() string {
	q := url.Values{"consumer": {b.Key.Consumer}, "kind": {b.Key.Kind.String()}, "key": {b.Key.Key}, "token": {strconv.FormatInt(b.Token, 10)}}
	return q.Encode()
}

func parseBulkTarget(s string) (bulkTarget, error) {
	q, err := url.ParseQuery(s)
	if err != nil {
		return bulkTarget{}, errors.New("a selected record cannot be read")
	}
	t := bulkTarget{Key: recordKey{Consumer: q.Get("consumer"), Key: q.Get("key")}}
	kind, ok := idemregv1.Kind_value[q.Get("kind")]
	t.Key.Kind = idemregv1.Kind(kind)
	t.Token, err = strconv.ParseInt(q.Get("token"), 10, 64)
	if !ok || kind == 0 || t.Key.Consumer == "" || t.Key.Key == "" || err != nil || t.Token <= 0 {
		return bulkTarget{}, errors.New("a selected record cannot be read: list the records again")
	}
	return t, nil
}

// bulkView is the confirmation of a bulk action, and then its outcome.
type bulkView struct {
	Action  string // bulkRelease or bulkInvalidate
	Reason  string
	Targets []bulkTarget
	// Results, once done: one per target, in order.
	Results []bulkResult
	Done    int // how many were done
	Back    string
}

// Verb is the action as the page says it.
func (v bulkView) Verb() string {
	if v.Action == bulkRelease {
		return "Release"
	}
	return "Invalidate"
}

// bulkResult is what became of one target.
type bulkResult struct {
	Target bulkTarget
	OK     bool
	Error  string
}

// bulk is a two-step POST like invalidate: the records page's selection,
// an action and a reason are checked and shown for confirmation; with
// confirm=yes each record is resolved by release or invalidated by a call
// of its own, with the token the operator saw, so that each is audited as
// a single action is and a record someone acted on since is refused alone.
func (c *Console) bulk(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.page(s)
	view := bulkView{Action: r.PostFormValue("action"), Reason: r.PostFormValue("reason"), Back: safeBack(r.PostFormValue("back"))}
	var errs []error
	if view.Action != bulkRelease && view.Action != bulkInvalidate {
		errs = append(errs, errors.New("choose what to do with the selected records: release them for a fresh attempt, or invalidate them"))
	}
	if err := checkReason(view.Reason); err != nil {
		errs = append(errs, err)
	}
	selected := r.PostForm["select"]
	switch {
	case len(selected) == 0:
		errs = append(errs, errors.New("select at least one record"))
	case len(selected) > maxBulkRecords:
		errs = append(errs, fmt.Errorf("at most %d records at once, got %d", maxBulkRecords, len(selected)))
	}
	seen := map[string]bool{}
	for _, v := range selected {
		t, err := parseBulkTarget(v)
		if err != nil {
			errs = append(errs, err)
			break
		}
		if !seen[v] {
			seen[v] = true
			view.Targets = append(view.Targets, t)
		}
	}
	if err := errors.Join(errs...); err != nil {
		p.Error = "Nothing done: " + err.Error()
		c.render(w, http.StatusBadRequest, "error.html", p)
		return
	}
	if r.PostFormValue("confirm") != "yes" {
		p.Data = view
		c.render(w, http.StatusOK, "bulk.html", p)
		return
	}
	for _, t := range view.Targets {
		ctx, cancel := c.callContext(r.Context(), s)
		var err error
		if view.Action == bulkRelease {
			_, err = c.admin.ResolveRecord(ctx, &idemregv1.ResolveRecordRequest{Consumer: t.Key.Consumer, Kind: t.Key.Kind, Key: t.Key.Key,
				Token: t.Token, Reason: view.Reason, Resolution: &idemregv1.ResolveRecordRequest_Release{Release: true}})
		} else {
			_, err = c.admin.InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: t.Key.Consumer, Kind: t.Key.Kind, Key: t.Key.Key,
				Token: t.Token, Reason: view.Reason})
		}
		cancel()
		res := bulkResult{Target: t, OK: err == nil}
		if err != nil {
			_, res.Error = explain(err)
		} else {
			view.Done++
		}
		view.Results = append(view.Results, res)
	}
	c.cfg.Logger.Info("console bulk action", "identity", s.identity, "action", view.Action, "records", len(view.Targets), "done", view.Done)
	p.Data = view
	p.Notice = fmt.Sprintf("%s: %d of %d records done.", view.Verb(), view.Done, len(view.Targets))
	c.render(w, http.StatusOK, "bulk.html", p)
}

// safeBack is a records page link the bulk pages lead back to, or the
// records page: only a path of this console.
func safeBack(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.Scheme != "" || u.Host != "" || u.Path != "/records" {
		return "/records"
	}
	return u.RequestURI()
}
