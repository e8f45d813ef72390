package console

import (
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/resulttype"
)

// The resolve form's choices.
const (
	actionRelease   = "release"
	actionComplete  = "complete"
	outcomeResponse = "response"
	outcomeFailure  = "failure"
	encodingText    = "text"
	encodingBase64  = "base64"
	encodingJSON    = "json"
)

// Bounds of a result typed into the resolve form: a result an operator
// writes by hand is short, and the whole form must fit in maxFormBytes.
const (
	maxResultDataBytes     = 8 << 10
	maxResultTypeBytes     = 256
	maxFailureMessageBytes = 1024
)

// resolveForm is the resolve form's fields as submitted. The record page
// fills them in again when a submission is refused; the confirmation
// carries them in canonical form (canonical).
type resolveForm struct {
	Reason  string
	Action  string // actionRelease or actionComplete
	Outcome string // outcomeResponse or outcomeFailure, with actionComplete
	Type    string // the response's type
	Data    string // the response's bytes, as Encoding says
	// Encoding is encodingText (UTF-8, line breaks as \n), encodingBase64,
	// or encodingJSON (the protobuf JSON mapping of a known type, encoded
	// here).
	Encoding string
	Code     string // the failure's google.rpc.Code, 1-16
	Message  string // the failure's message
}

func postedResolveForm(r *http.Request) resolveForm {
	return resolveForm{
		Reason: r.PostFormValue("reason"), Action: r.PostFormValue("action"), Outcome: r.PostFormValue("outcome"),
		Type: r.PostFormValue("type"), Data: r.PostFormValue("data"), Encoding: r.PostFormValue("encoding"),
		Code: r.PostFormValue("code"), Message: r.PostFormValue("message"),
	}
}

// resolution is a checked resolve form: what ResolveRecord is asked to do.
type resolution struct {
	Release bool
	Result  *idemregv1.Result // when not Release
}

// parse checks f and returns the resolution it asks for. A response of a
// type that types know must decode as it, or be given as JSON: the
// AdminService would refuse it anyway, and the confirmation must not
// show what the call would refuse.
func (f resolveForm) parse(types *resulttype.Types) (resolution, error) {
	if err := checkReason(f.Reason); err != nil {
		return resolution{}, err
	}
	switch f.Action {
	case actionRelease:
		return resolution{Release: true}, nil
	case actionComplete:
	default:
		return resolution{}, errors.New("choose what to do: release the record for a fresh attempt, or complete it with a result")
	}
	switch f.Outcome {
	case outcomeResponse:
		if err := checkText("the response's type", f.Type, maxResultTypeBytes); err != nil {
			return resolution{}, err
		}
		data, err := f.data(types)
		if err != nil {
			return resolution{}, err
		}
		return resolution{Result: &idemregv1.Result{Outcome: &idemregv1.Result_Response{Response: &idemregv1.Response{Type: f.Type, Data: data}}}}, nil
	case outcomeFailure:
		code, err := strconv.Atoi(f.Code)
		if err != nil || code < 1 || code > 16 {
			return resolution{}, fmt.Errorf("a failure needs a gRPC code other than OK (1-16), got %q", f.Code)
		}
		if err := checkText("the failure's message", f.Message, maxFailureMessageBytes); err != nil {
			return resolution{}, err
		}
		return resolution{Result: &idemregv1.Result{Outcome: &idemregv1.Result_Failure{Failure: &idemregv1.Failure{Code: int32(code), Message: f.Message}}}}, nil
	default:
		return resolution{}, errors.New("choose the result: a response (type and data) or a failure (code and message)")
	}
}

// data is the response's bytes the form gives, checked against its type
// when types know it.
func (f resolveForm) data(types *resulttype.Types) ([]byte, error) {
	var data []byte
	switch f.Encoding {
	case encodingJSON:
		if len(f.Data) > maxResultDataBytes {
			return nil, fmt.Errorf("the response's JSON must be at most %d bytes here, got %d", maxResultDataBytes, len(f.Data))
		}
		var err error
		data, err = types.Encode(f.Type, f.Data)
		switch {
		case errors.Is(err, resulttype.ErrUnknownType):
			return nil, fmt.Errorf("the registry does not know the type %q (neither linked into the server nor in its --descriptor-set), so it cannot encode JSON of it: give its wire format as text or base64", f.Type)
		case err != nil:
			return nil, fmt.Errorf("the response's JSON is not %s in the protobuf JSON mapping: %v", f.Type, err)
		}
	case encodingText:
		if !utf8.ValidString(f.Data) {
			return nil, errors.New("the response's data is not valid UTF-8 text: give it as base64")
		}
		// Browsers send a textarea's line breaks as CRLF; what an operator
		// typed as one line break is \n.
		data = []byte(strings.ReplaceAll(f.Data, "\r\n", "\n"))
	case encodingBase64:
		s := strings.Join(strings.Fields(f.Data), "")
		var err error
		if data, err = base64.StdEncoding.DecodeString(s); err != nil {
			if data, err = base64.RawStdEncoding.DecodeString(s); err != nil {
				return nil, errors.New("the response's data is not valid base64")
			}
		}
	default:
		return nil, errors.New("choose how the response's data is written: text, base64 or JSON")
	}
	if len(data) > maxResultDataBytes {
		return nil, fmt.Errorf("the response's data must be at most %d bytes here, got %d (complete a larger result from the service itself)", maxResultDataBytes, len(data))
	}
	if _, err := types.Check(f.Type, data); err != nil {
		return nil, fmt.Errorf("the response's data does not decode as %s (%v): write it as JSON instead, which is encoded for you", f.Type, err)
	}
	return data, nil
}

// canonical is the form the confirmation carries for res: the data in
// base64, so that it comes back byte for byte, and nothing the resolution
// does not use.
func canonical(reason string, res resolution) resolveForm {
	f := resolveForm{Reason: reason, Action: actionRelease}
	if res.Release {
		return f
	}
	f.Action = actionComplete
	if fail := res.Result.GetFailure(); fail != nil {
		f.Outcome, f.Code, f.Message = outcomeFailure, strconv.Itoa(int(fail.GetCode())), fail.GetMessage()
		return f
	}
	resp := res.Result.GetResponse()
	f.Outcome, f.Type, f.Encoding = outcomeResponse, resp.GetType(), encodingBase64
	f.Data = base64.StdEncoding.EncodeToString(resp.GetData())
	return f
}

// checkReason holds an operator's reason to the AdminService's rule
// (server.MaxReasonBytes, printable UTF-8), so that a confirmation is never
// shown for a reason the call would refuse.
func checkReason(reason string) error {
	if reason == "" {
		return errors.New("a reason is required: say why, for the audit log and the record's history")
	}
	return checkText("the reason", reason, maxReasonBytes)
}

// checkText refuses a value longer than limit bytes, not UTF-8, or with a
// character that is not printable.
func checkText(what, s string, limit int) error {
	if len(s) > limit {
		return fmt.Errorf("%s must be at most %d bytes, got %d", what, limit, len(s))
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%s must be valid UTF-8", what)
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return fmt.Errorf("%s must be printable, found U+%04X", what, r)
		}
	}
	return nil
}

// failureCode is a choice of the failure code select.
type failureCode struct {
	Code int
	Name string
}

func failureCodes() []failureCode {
	out := make([]failureCode, 0, 16)
	for c := codes.Canceled; c <= codes.Unauthenticated; c++ {
		out = append(out, failureCode{Code: int(c), Name: c.String()})
	}
	return out
}

// resolveConfirmView is the confirmation step of a resolution.
type resolveConfirmView struct {
	Key    recordKey
	Token  int64
	Reason string
	// Form is the canonical form, for the confirmation's hidden fields.
	Form    resolveForm
	Release bool
	Result  *resultView // the result to store, when not Release
	// JSON is the response to store decoded and written as JSON, when its
	// type is known: what the operator can check the bytes against.
	JSON string
	// Record is the record as it is now.
	Record recordView
}

// resolve is a two-step POST like invalidate: without confirm=yes it checks
// the form and shows exactly what will be done; with it, it calls
// ResolveRecord with the token the record page showed, so that of two
// operators only the first acts and the second is told so.
func (c *Console) resolve(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.page(s)
	k, token, err := formTarget(r)
	if err != nil {
		p.Error = err.Error()
		c.render(w, http.StatusBadRequest, "error.html", p)
		return
	}
	form := postedResolveForm(r)
	res, ferr := form.parse(c.cfg.Types)
	if ferr != nil {
		view, code, msg := c.inspect(r.Context(), s, k)
		view.Form = form
		p.Data, p.Error = view, "Not resolved: "+ferr.Error()+"."
		if msg != "" {
			p.Error = msg
		}
		c.render(w, max(code, http.StatusBadRequest), "record.html", p)
		return
	}
	if r.PostFormValue("confirm") != "yes" {
		view, code, msg := c.inspect(r.Context(), s, k)
		switch {
		case msg != "":
			p.Data, p.Error = view, msg
			c.render(w, code, "record.html", p)
		case view.Token != token:
			view.Form = form
			p.Data, p.Error = view, someoneActedFirst
			c.render(w, http.StatusConflict, "record.html", p)
		case !view.Resolvable:
			p.Data, p.Error = view, "Refused: only a live record can be resolved; this one has expired."
			c.render(w, http.StatusConflict, "record.html", p)
		case view.IsCompleted && res.Release:
			view.Form = form
			p.Data, p.Error = view, "Refused: a completed record is not released; give a result to repair the stored one, or invalidate the record to drop it."
			c.render(w, http.StatusConflict, "record.html", p)
		default:
			confirm := resolveConfirmView{Key: k, Token: token, Reason: form.Reason, Form: canonical(form.Reason, res), Release: res.Release, Record: view}
			if !res.Release {
				confirm.Result = showResult(res.Result)
				confirm.JSON = c.responseJSON(res.Result.GetResponse())
			}
			p.Data = confirm
			c.render(w, http.StatusOK, "resolve.html", p)
		}
		return
	}
	req := &idemregv1.ResolveRecordRequest{Consumer: k.Consumer, Kind: k.Kind, Key: k.Key, Token: token, Reason: form.Reason}
	done := "released"
	if res.Release {
		req.Resolution = &idemregv1.ResolveRecordRequest_Release{Release: true}
	} else {
		req.Resolution = &idemregv1.ResolveRecordRequest_Result{Result: res.Result}
		done = "completed"
	}
	ctx, cancel := c.callContext(r.Context(), s)
	defer cancel()
	if _, err := c.admin.ResolveRecord(ctx, req); err != nil {
		code, msg := explain(err)
		view, _, _ := c.inspect(r.Context(), s, k)
		p.Data, p.Error = view, msg
		c.render(w, code, "record.html", p)
		return
	}
	c.cfg.Logger.Info("console resolution", "identity", s.identity, "resolution", done)
	http.Redirect(w, r, "/record?"+k.Query()+"&done="+done, http.StatusSeeOther)
}

// responseJSON is resp decoded and written in the protobuf JSON mapping,
// or "" when resp is not a response of a known type (its bytes were
// checked to decode already, by parse).
func (c *Console) responseJSON(resp *idemregv1.Response) string {
	mt, ok := c.cfg.Types.Find(resp.GetType())
	if !ok {
		return ""
	}
	m := mt.New().Interface()
	if err := (proto.UnmarshalOptions{Resolver: c.cfg.Types}).Unmarshal(resp.GetData(), m); err != nil {
		return ""
	}
	b, err := protojson.MarshalOptions{Resolver: c.cfg.Types, Multiline: true}.Marshal(m)
	if err != nil {
		return ""
	}
	return string(b)
}
