package idemhttp

import (
	"bytes"
	"errors"
	"net/http"

	"google.golang.org/protobuf/encoding/protowire"
)

// ResponseType is the type name of the response the middleware stores for
// a key, as an operator sees it with idemreg admin: the protobuf message
//
//	message Response {          // idemreg.http.v1.Response
//	  uint32 status = 1;
//	  repeated Header headers = 2;  // the headers WithReplayHeaders chose
//	  bytes body = 3;
//	  bytes fingerprint = 4;        // of the request answered; absent in older records
//	  message Header { string name = 1; string value = 2; }
//	}
//
// It is encoded by hand (protowire) so that the package needs no generated
// code: any protobuf runtime given the message above decodes it.
const ResponseType = "idemreg.http.v1.Response"

type storedResponse struct {
	status int
	header http.Header
	body   []byte
	// fingerprint is the request's that got the response; nil in a
	// response recorded before it was kept here.
	fingerprint []byte
}

func (r storedResponse) encode() []byte {
	b := protowire.AppendTag(nil, 1, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(r.status))
	for name, vals := range r.header {
		for _, v := range vals {
			var h []byte
			h = protowire.AppendTag(h, 1, protowire.BytesType)
			h = protowire.AppendString(h, name)
			h = protowire.AppendTag(h, 2, protowire.BytesType)
			h = protowire.AppendString(h, v)
			b = protowire.AppendTag(b, 2, protowire.BytesType)
			b = protowire.AppendBytes(b, h)
		}
	}
	b = protowire.AppendTag(b, 3, protowire.BytesType)
	b = protowire.AppendBytes(b, r.body)
	if len(r.fingerprint) > 0 {
		b = protowire.AppendTag(b, 4, protowire.BytesType)
		b = protowire.AppendBytes(b, r.fingerprint)
	}
	return b
}

var errMalformed = errors.New("not an encoded " + ResponseType)

func decodeResponse(b []byte) (storedResponse, error) {
	r := storedResponse{header: http.Header{}}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return r, errMalformed
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 || v < 100 || v > 999 {
				return r, errMalformed
			}
			r.status, b = int(v), b[n:]
		case num == 2 && typ == protowire.BytesType:
			h, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return r, errMalformed
			}
			b = b[n:]
			var name, value string
			for len(h) > 0 {
				hn, ht, m := protowire.ConsumeTag(h)
				if m < 0 || ht != protowire.BytesType {
					return r, errMalformed
				}
				h = h[m:]
				s, m := protowire.ConsumeString(h)
				if m < 0 {
					return r, errMalformed
				}
				h = h[m:]
				switch hn {
				case 1:
					name = s
				case 2:
					value = s
				}
			}
			if name != "" {
				r.header.Add(name, value)
			}
		case num == 3 && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return r, errMalformed
			}
			r.body, b = append([]byte(nil), v...), b[n:]
		case num == 4 && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return r, errMalformed
			}
			r.fingerprint, b = append([]byte(nil), v...), b[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return r, errMalformed
			}
			b = b[n:]
		}
	}
	if r.status == 0 {
		return r, errMalformed
	}
	return r, nil
}

// recorder buffers a handler's response so that it is recorded before the
// client sees it: a client that gets an answer can count on a retry
// getting the same one. A response longer than limit cannot be recorded;
// it is then sent on as the handler writes it (overflow), and the key is
// completed with a failure that says so, since its effect did happen.
type recorder struct {
	w      http.ResponseWriter
	header http.Header
	status int
	body   bytes.Buffer
	limit  int
	// overflow: the buffered part went out, and the rest goes straight on.
	overflow bool
}

func newRecorder(w http.ResponseWriter, limit int) *recorder {
	return &recorder{w: w, header: http.Header{}, limit: limit}
}

func (r *recorder) Header() http.Header {
	if r.overflow {
		return r.w.Header()
	}
	return r.header
}

func (r *recorder) WriteHeader(code int) {
	switch {
	case r.status != 0 || r.overflow:
		// A second status: net/http ignores it too.
	case code >= 100 && code < 200 && code != http.StatusSwitchingProtocols:
		// Informational (103 Early Hints): not the response; it goes out
		// at once and is not recorded.
		r.w.WriteHeader(code)
	default:
		r.status = code
	}
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	if r.overflow {
		return r.w.Write(p)
	}
	if r.body.Len()+len(p) <= r.limit {
		return r.body.Write(p)
	}
	r.overflow = true
	r.send(nil)
	return r.w.Write(p)
}

// send writes the buffered response to the client, with extra headers.
func (r *recorder) send(extra http.Header) {
	h := r.w.Header()
	for k, v := range r.header {
		h[k] = v
	}
	for k, v := range extra {
		h[k] = v
	}
	status := r.status
	if status == 0 {
		status = http.StatusOK
	}
	r.w.WriteHeader(status)
	_, _ = r.w.Write(r.body.Bytes())
}

// The recorder has no Flush and no Unwrap: flushing would show the client
// a response that is not recorded yet (and could still be replaced by an
// answer of the middleware's), so http.ResponseController's Flush reports
// http.ErrNotSupported while the response is buffered.

// stored is the response to record: the status, the chosen headers and
// the body.
func (r *recorder) stored(replayHeaders []string) storedResponse {
	h := http.Header{}
	for _, name := range replayHeaders {
		if v, ok := r.header[http.CanonicalHeaderKey(name)]; ok {
			h[http.CanonicalHeaderKey(name)] = v
		}
	}
	status := r.status
	if status == 0 {
		status = http.StatusOK
	}
	return storedResponse{status: status, header: h, body: r.body.Bytes()}
}
