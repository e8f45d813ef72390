package console

import (
	"context"
	"encoding/hex"
	"errors"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// recordKey is the (consumer, kind, key) of a form or query.
type recordKey struct {
	Consumer, Key string
	Kind          idemregv1.Kind
}

// KindName is the key's kind in words.
func (k recordKey) KindName() string { return kindName(k.Kind) }

// Bulk is the record with token as a bulk action's selection.
func (k recordKey) Bulk(token int64) bulkTarget { return bulkTarget{Key: k, Token: token} }

func (k recordKey) Query() string {
	return url.Values{"consumer": {k.Consumer}, "kind": {k.Kind.String()}, "key": {k.Key}}.Encode()
}

// Link is the record page of k. It is a template.URL because html/template
// escapes a value after a URL's "?" as one query component, "=" and "&"
// included; Query's encoding already made it safe.
func (k recordKey) Link() template.URL { return template.URL("/record?" + k.Query()) }

func formKey(r *http.Request) (recordKey, error) {
	k := recordKey{Consumer: r.FormValue("consumer"), Key: r.FormValue("key")}
	kind, ok := idemregv1.Kind_value[r.FormValue("kind")]
	if !ok || kind == 0 {
		return k, errors.New("choose a kind: KIND_MESSAGE or KIND_OPERATION")
	}
	k.Kind = idemregv1.Kind(kind)
	if k.Consumer == "" || k.Key == "" {
		return k, errors.New("give a consumer and a key")
	}
	return k, nil
}

// formTarget reads the record key and the token a record page's action
// form carries: the token is the one the operator saw, which the
// AdminService checks, so that an action on a record changed since is
// refused.
func formTarget(r *http.Request) (recordKey, int64, error) {
	k, err := formKey(r)
	if err != nil {
		return k, 0, err
	}
	token, err := strconv.ParseInt(r.PostFormValue("token"), 10, 64)
	if err != nil || token <= 0 {
		return k, 0, errors.New("the form has no record token: look the record up again")
	}
	return k, token, nil
}

// recordView is the record page.
type recordView struct {
	Key       recordKey
	Found     bool
	Live      bool
	StoreTime timeView
	State     string // in words (stateLabel)
	// InProgress, Parked: the record's state, for the templates' choices.
	InProgress, Parked bool
	Token              int64
	Attempt            int64
	Holder             string
	Created            timeView
	LeaseEnds          timeView
	LeaseLive          bool
	Completed          timeView
	Expires            timeView
	HasFP              bool
	ParkReason         string
	Result             *resultView
	History            []attemptView
	// Resolvable: live (ResolveRecord's rule); a completed record only
	// with a result, which repairs the stored one (IsCompleted).
	Resolvable  bool
	IsCompleted bool
	// Form is the resolve form's fields, filled in again when a submission
	// was refused.
	Form resolveForm
}

// attemptView is one earlier attempt of the record page's history.
type attemptView struct {
	Attempt    int64
	Token      int64
	Holder     string
	Acquired   timeView
	Ended      timeView
	End        string
	ParkReason string
	Note       string
}

func showHistory(now time.Time, h []*idemregv1.Attempt) []attemptView {
	out := make([]attemptView, 0, len(h))
	for _, a := range h {
		out = append(out, attemptView{
			Attempt: a.GetAttempt(), Token: a.GetToken(), Holder: a.GetHolder(),
			Acquired: when(now, a.GetAcquiredAt()), Ended: when(now, a.GetEndedAt()), End: attemptEnd(a.GetEnd()),
			ParkReason: a.GetParkReason(), Note: a.GetNote(),
		})
	}
	return out
}

func attemptEnd(e idemregv1.AttemptEnd) string {
	switch e {
	case idemregv1.AttemptEnd_ATTEMPT_END_TAKEN_OVER:
		return "taken over (its lease ended)"
	case idemregv1.AttemptEnd_ATTEMPT_END_INVALIDATED:
		return "invalidated by an operator"
	case idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_COMPLETED:
		return "resolved by an operator: completed"
	case idemregv1.AttemptEnd_ATTEMPT_END_RESOLVED_RELEASED:
		return "resolved by an operator: released"
	default:
		return e.String()
	}
}

// resultView shows a stored result without ever rendering it: its type and
// size and a hex preview of its bytes, or a failure's code and message.
type resultView struct {
	Kind, Type, Preview, Message string
	Size                         int
	Truncated                    bool
}

func (c *Console) record(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.page(s)
	k, err := formKey(r)
	if err != nil {
		p.Error = err.Error()
		c.render(w, http.StatusBadRequest, "record.html", p)
		return
	}
	switch r.FormValue("done") {
	case "invalidated":
		p.Notice = "Invalidated: the next Claim of the key acquires it, as a takeover."
	case "completed":
		p.Notice = "Resolved with your result: the record is completed, and every Claim of the key replays it."
	case "released":
		p.Notice = "Resolved by a release: the next Claim of the key acquires it as attempt 1."
	}
	view, code, msg := c.inspect(r.Context(), s, k)
	p.Data, p.Error = view, msg
	c.render(w, code, "record.html", p)
}

func (c *Console) inspect(ctx context.Context, s *session, k recordKey) (recordView, int, string) {
	view := recordView{Key: k}
	ctx, cancel := c.callContext(ctx, s)
	defer cancel()
	res, err := c.admin.InspectRecord(ctx, &idemregv1.InspectRecordRequest{Consumer: k.Consumer, Kind: k.Kind, Key: k.Key})
	if err != nil {
		code, msg := explain(err)
		return view, code, msg
	}
	rec := res.GetRecord()
	view.Found = true
	view.Live = res.GetLive()
	now := res.GetStoreTime().AsTime()
	view.StoreTime = when(time.Time{}, res.GetStoreTime())
	view.State = stateLabel(rec, res.GetHistory())
	view.InProgress = rec.GetState() == idemregv1.State_STATE_IN_PROGRESS
	view.Parked = rec.GetState() == idemregv1.State_STATE_PARKED
	view.Token = rec.GetToken()
	view.Attempt = rec.GetAttempt()
	view.Holder = rec.GetHolder()
	view.Created = when(now, rec.GetCreatedAt())
	view.LeaseEnds = when(now, rec.GetLeaseExpiresAt())
	view.Completed = when(now, rec.GetCompletedAt())
	view.Expires = when(now, rec.GetExpiresAt())
	view.HasFP = len(rec.GetFingerprint()) > 0
	view.ParkReason = rec.GetParkReason()
	view.LeaseLive = rec.GetState() == idemregv1.State_STATE_IN_PROGRESS && rec.GetLeaseExpiresAt().AsTime().After(now)
	if result := rec.GetResult(); result != nil {
		view.Result = showResult(result)
	}
	view.History = showHistory(now, res.GetHistory())
	view.IsCompleted = rec.GetState() == idemregv1.State_STATE_COMPLETED
	view.Resolvable = view.Live
	view.Form = resolveForm{Action: actionRelease, Outcome: outcomeResponse, Encoding: encodingText}
	return view, http.StatusOK, ""
}

func showResult(res *idemregv1.Result) *resultView {
	if f := res.GetFailure(); f != nil {
		return &resultView{Kind: "failure", Type: codes.Code(f.GetCode()).String(), Message: f.GetMessage(), Size: len(f.GetMessage())}
	}
	data := res.GetResponse().GetData()
	v := &resultView{Kind: "response", Type: res.GetResponse().GetType(), Size: len(data)}
	if len(data) > previewBytes {
		data, v.Truncated = data[:previewBytes], true
	}
	v.Preview = hex.EncodeToString(data)
	return v
}

// Messages of the refusals an operator acting on a record meets.
const (
	someoneActedFirst = "Someone acted first: the record's token is no longer the one you saw, so nothing was done. Here is the record as it is now: look at it again before you decide."
	alreadyCompleted  = "Refused: the record is completed, and its result is what every Claim replays. Invalidate it to drop the result."
)

// explain turns a call's error into the page's status and message.
func explain(err error) (int, string) {
	st := status.Convert(err)
	switch errorReason(st) {
	case idemregv1.ReasonLeaseLost:
		return http.StatusConflict, someoneActedFirst
	case idemregv1.ReasonAlreadyCompleted:
		return http.StatusConflict, alreadyCompleted
	}
	switch st.Code() {
	case codes.PermissionDenied:
		return http.StatusForbidden, "Permission denied: " + st.Message() + ". Your identity needs an admin grant for this consumer in --config."
	case codes.Unauthenticated:
		return http.StatusUnauthorized, "Not authenticated: " + st.Message() + ". Sign out and sign in again."
	case codes.NotFound:
		return http.StatusNotFound, "No record: " + st.Message()
	case codes.InvalidArgument:
		return http.StatusBadRequest, "Invalid request: " + st.Message()
	case codes.FailedPrecondition:
		return http.StatusConflict, "Refused: " + st.Message() + " (the record changed since it was shown: look it up again)"
	default:
		return http.StatusBadGateway, st.Code().String() + ": " + st.Message()
	}
}

// errorReason is the idemreg ErrorInfo reason of st, or "".
func errorReason(st *status.Status) string {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == idemregv1.ErrorDomain {
			return info.GetReason()
		}
	}
	return ""
}

// confirmView is the confirmation step of an invalidation.
type confirmView struct {
	Key    recordKey
	Token  int64
	Reason string
}

// invalidate is a two-step POST: without confirm=yes it shows what will be
// done and asks; with it, it calls InvalidateRecord with the token the
// record page showed, so that a record changed since is not invalidated.
func (c *Console) invalidate(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.page(s)
	k, token, err := formTarget(r)
	if err != nil {
		p.Error = err.Error()
		c.render(w, http.StatusBadRequest, "error.html", p)
		return
	}
	reason := r.PostFormValue("reason")
	if err := checkReason(reason); err != nil {
		view, code, msg := c.inspect(r.Context(), s, k)
		p.Data, p.Error = view, "A reason is required: say why, for the audit log."
		if reason != "" {
			p.Error = "Not invalidated: " + err.Error() + "."
		}
		if msg != "" {
			p.Error = msg
		}
		c.render(w, max(code, http.StatusBadRequest), "record.html", p)
		return
	}
	if r.PostFormValue("confirm") != "yes" {
		p.Data = confirmView{Key: k, Token: token, Reason: reason}
		c.render(w, http.StatusOK, "confirm.html", p)
		return
	}
	ctx, cancel := c.callContext(r.Context(), s)
	defer cancel()
	_, err = c.admin.InvalidateRecord(ctx, &idemregv1.InvalidateRecordRequest{Consumer: k.Consumer, Kind: k.Kind, Key: k.Key, Token: token, Reason: reason})
	if err != nil {
		code, msg := explain(err)
		view, _, _ := c.inspect(r.Context(), s, k)
		p.Data, p.Error = view, msg
		c.render(w, code, "record.html", p)
		return
	}
	c.cfg.Logger.Info("console invalidation", "identity", s.identity)
	http.Redirect(w, r, "/record?"+k.Query()+"&done=invalidated", http.StatusSeeOther)
}
