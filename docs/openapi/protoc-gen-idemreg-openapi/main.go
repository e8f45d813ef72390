// Command protoc-gen-idemreg-openapi writes the OpenAPI 3.1 document of
// the registry's HTTP/JSON API (docs/openapi/idemreg.openapi.json) from
// the .proto files, as a buf plugin, so that the document cannot say
// what the API does not: `make generate` runs it, and `make test`
// (.ci/test) regenerates it and fails on a difference.
//
// It runs as a plugin rather than over the Go types' registered
// descriptors because only the plugin's request carries the .proto
// comments, which are the API's documentation. The API's JSON is the one
// the HTTP side speaks (cmd/idemreg/internal/sharedport: vanguard over the
// gRPC server, the Connect protocol's unary POST), so the document says
// that mapping once, in info.description, and on each schema it touches.
//
// Examples come from a hand-written file (opt examples=PATH): one request
// and one response for every method, which the generator requires, and
// which TestOpenAPIExamples (cmd/idemreg/internal/sharedport) sends to a
// real server.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"

	"google.golang.org/protobuf/compiler/protogen"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/pluginpb"
)

func main() {
	var examplesPath, out string
	protogen.Options{ParamFunc: func(name, value string) error {
		switch name {
		case "examples":
			examplesPath = value
		case "out":
			out = value
		default:
			return fmt.Errorf("unknown option %q", name)
		}
		return nil
	}}.Run(func(p *protogen.Plugin) error {
		p.SupportedFeatures = uint64(pluginpb.CodeGeneratorResponse_FEATURE_SUPPORTS_EDITIONS)
		p.SupportedEditionsMinimum, p.SupportedEditionsMaximum = descriptorpb.Edition_EDITION_PROTO2, descriptorpb.Edition_EDITION_2023
		if examplesPath == "" || out == "" {
			return fmt.Errorf("opt examples=PATH and out=NAME are required")
		}
		raw, err := os.ReadFile(examplesPath)
		if err != nil {
			return err
		}
		var examples map[string]example
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&examples); err != nil {
			return fmt.Errorf("%s: %w", examplesPath, err)
		}
		doc, err := document(p, examples)
		if err != nil {
			return err
		}
		var b bytes.Buffer
		enc := json.NewEncoder(&b)
		enc.SetEscapeHTML(false)
		enc.SetIndent("", "  ")
		if err := enc.Encode(doc); err != nil {
			return err
		}
		_, err = p.NewGeneratedFile(out, "").Write(b.Bytes())
		return err
	})
}

// example is one method's example request and response, as the API's
// JSON.
type example struct {
	Summary  string          `json:"summary"`
	Request  json.RawMessage `json:"request"`
	Response json.RawMessage `json:"response"`
}

// obj is a JSON object; encoding/json writes its keys sorted, so the
// document is the same for the same input.
type obj = map[string]any

// mapping is what the API's JSON does with protobuf's types: the
// protobuf JSON mapping (protojson), as vanguard's codec speaks it.
const mapping = `The HTTP/JSON API is the gRPC API transcoded on the gRPC port (HTTP/1.1; docs/operations.md, "HTTP/1.1 on the gRPC port"): each method is a POST to /<package>.<Service>/<Method> with a JSON body, Content-Type: application/json (the Connect protocol's unary call; the server adds Connect-Protocol-Version: 1 when it is missing), and a bearer token in Authorization when the registry names identities.

The JSON is protobuf's JSON mapping:
- field names are lowerCamelCase (claimSecret); the .proto names (claim_secret) are accepted too;
- bytes are base64 (standard, with padding; URL-safe is accepted): fingerprint, claimSecret, data;
- 64-bit integers (token, attempt) are strings, "42"; a JSON number is accepted;
- durations are strings of seconds with an "s": "3600s", "1.5s";
- timestamps are RFC 3339 strings in UTC: "2026-12-05T10:00:00Z";
- enums are their names ("KIND_MESSAGE"); numbers are accepted;
- answers carry every field, set or not: a message that is not set is null, an empty string or bytes "", a number 0 ("0" if 64-bit), a repeated field [], an enum its _UNSPECIFIED name; a request may leave any field out;
- a field a request's message does not have is ignored (a misspelt field is a field left out); a body that is not JSON, or a value of the wrong type, is INVALID_ARGUMENT (a 400, reason MALFORMED_REQUEST);
- google.protobuf.Any (google.rpc.Status's details in a batch item's error) is an object with "@type" and the message's own fields.

Errors are the Connect protocol's error body (ConnectError) with the HTTP status of its code: invalid_argument, failed_precondition and out_of_range 400, unauthenticated 401, permission_denied 403, not_found 404, already_exists and aborted 409, resource_exhausted 429, canceled 499, unknown, internal and data_loss 500, unimplemented 501, unavailable 503, deadline_exceeded 504. Its details are the gRPC status's: google.rpc.ErrorInfo (domain "idemreg.dev", reason an ErrorReason name), google.rpc.BadRequest (the fields at fault), google.rpc.RetryInfo (when to retry); each detail's value is the message's binary form in base64, and debug the same as JSON. A batch's per-item errors are google.rpc.Status in JSON inside a 200 (BatchItemResult.error).`

func document(p *protogen.Plugin, examples map[string]example) (obj, error) {
	schemas := obj{
		"ConnectError": connectError(),
		"google.protobuf.Any": obj{
			"type":                 "object",
			"description":          "A message of the type its \"@type\" names (type.googleapis.com/<full name>), with that message's JSON fields beside it.",
			"properties":           obj{"@type": obj{"type": "string", "example": "type.googleapis.com/google.rpc.ErrorInfo"}},
			"required":             []string{"@type"},
			"additionalProperties": true,
		},
	}
	paths := obj{}
	used := map[string]bool{}
	var files []*protogen.File
	for _, f := range p.Files {
		if f.Generate {
			files = append(files, f)
		}
	}
	seen := map[protoreflect.FullName]bool{}
	var addMessage func(m *protogen.Message)
	addEnum := func(e *protogen.Enum) {
		if seen[e.Desc.FullName()] {
			return
		}
		seen[e.Desc.FullName()] = true
		schemas[string(e.Desc.FullName())] = enumSchema(e)
	}
	addMessage = func(m *protogen.Message) {
		name := m.Desc.FullName()
		if seen[name] || wellKnown(name) != nil {
			return
		}
		seen[name] = true
		schemas[string(name)] = messageSchema(m)
		for _, f := range m.Fields {
			if f.Message != nil {
				if f.Desc.IsMap() {
					if v := f.Message.Fields[1]; v.Message != nil {
						addMessage(v.Message)
					} else if v.Enum != nil {
						addEnum(v.Enum)
					}
					continue
				}
				addMessage(f.Message)
			}
			if f.Enum != nil {
				addEnum(f.Enum)
			}
		}
	}
	var tags []obj
	for _, f := range files {
		for _, e := range f.Enums {
			addEnum(e)
		}
		for _, s := range f.Services {
			tags = append(tags, obj{"name": string(s.Desc.FullName()), "description": comment(s.Comments.Leading)})
			for _, m := range s.Methods {
				full := string(s.Desc.FullName()) + "/" + string(m.Desc.Name())
				ex, ok := examples[full]
				if !ok || len(ex.Request) == 0 || len(ex.Response) == 0 || ex.Summary == "" {
					return nil, fmt.Errorf("examples: %s needs a summary, a request and a response", full)
				}
				used[full] = true
				addMessage(m.Input)
				addMessage(m.Output)
				paths["/"+full] = obj{"post": obj{
					"operationId": strings.ReplaceAll(string(s.Desc.FullName()), ".", "_") + "_" + string(m.Desc.Name()),
					"tags":        []string{string(s.Desc.FullName())},
					"summary":     ex.Summary,
					"description": comment(m.Comments.Leading),
					"parameters": []obj{{
						"name": "Connect-Protocol-Version", "in": "header", "required": false,
						"description": "The Connect protocol's version; the server adds it when a JSON POST has none.",
						"schema":      obj{"type": "string", "enum": []string{"1"}},
					}},
					"requestBody": obj{"required": true, "content": obj{"application/json": obj{
						"schema":   ref(m.Input.Desc.FullName()),
						"examples": obj{"example": obj{"summary": ex.Summary, "value": ex.Request}},
					}}},
					"responses": obj{
						"200": obj{"description": "The method's answer.", "content": obj{"application/json": obj{
							"schema":   ref(m.Output.Desc.FullName()),
							"examples": obj{"example": obj{"value": ex.Response}},
						}}},
						"default": obj{"description": "An error: the Connect error body, with the HTTP status of its code (info.description).", "content": obj{"application/json": obj{
							"schema": obj{"$ref": "#/components/schemas/ConnectError"},
						}}},
					},
				}}
			}
		}
	}
	var extra []string
	for name := range examples {
		if !used[name] {
			extra = append(extra, name)
		}
	}
	if len(extra) > 0 {
		sort.Strings(extra)
		return nil, fmt.Errorf("examples: no such method: %s", strings.Join(extra, ", "))
	}
	return obj{
		"openapi": "3.1.0",
		"info": obj{
			"title":       "idemreg HTTP/JSON API",
			"version":     "v1",
			"description": mapping,
			"license":     obj{"name": "Apache-2.0", "identifier": "Apache-2.0"},
		},
		"servers":    []obj{{"url": "http://127.0.0.1:7350", "description": "idemreg serve's default --listen (gRPC and this API on one port)"}},
		"tags":       tags,
		"paths":      paths,
		"security":   []obj{{}, {"bearer": []string{}}},
		"components": obj{"schemas": schemas, "securitySchemes": obj{"bearer": obj{"type": "http", "scheme": "bearer", "description": "A token of an identity of --config; none when the registry names no identities (loopback, or --allow-unauthenticated)."}}},
	}, nil
}

func ref(name protoreflect.FullName) obj {
	if s := wellKnown(name); s != nil {
		return s
	}
	return obj{"$ref": "#/components/schemas/" + string(name)}
}

// wellKnown is the schema of a message whose JSON is not an object of its
// fields; nil for any other.
func wellKnown(name protoreflect.FullName) obj {
	switch name {
	case "google.protobuf.Duration":
		return obj{"type": "string", "pattern": `^-?[0-9]+(\.[0-9]{1,9})?s$`, "description": "A duration: seconds with an \"s\" (\"3600s\", \"0.250s\").", "example": "30s"}
	case "google.protobuf.Timestamp":
		return obj{"type": "string", "format": "date-time", "description": "An RFC 3339 time, in UTC (\"Z\").", "example": "2026-12-05T10:00:00Z"}
	case "google.protobuf.Any":
		return obj{"$ref": "#/components/schemas/google.protobuf.Any"}
	}
	return nil
}

func messageSchema(m *protogen.Message) obj {
	props := obj{}
	for _, f := range m.Fields {
		s := fieldSchema(f)
		if c := comment(f.Comments.Leading); c != "" {
			s = withDescription(s, c)
		}
		props[f.Desc.JSONName()] = s
	}
	desc := comment(m.Comments.Leading)
	for _, o := range m.Oneofs {
		if o.Desc.IsSynthetic() {
			continue
		}
		var names []string
		for _, f := range o.Fields {
			names = append(names, f.Desc.JSONName())
		}
		desc = strings.TrimSpace(desc + "\n\nAt most one of " + strings.Join(names, ", ") + " is set (oneof " + string(o.Desc.Name()) + ").")
	}
	// Not additionalProperties: false: the server ignores a field it does
	// not know, and accepts the .proto names beside the JSON ones.
	s := obj{"type": "object", "properties": props}
	if desc != "" {
		s["description"] = desc
	}
	return s
}

// withDescription puts d on s; a $ref cannot carry siblings in every
// tool, so it is wrapped.
func withDescription(s obj, d string) obj {
	if _, ok := s["$ref"]; ok {
		return obj{"allOf": []obj{s}, "description": d}
	}
	if _, ok := s["anyOf"]; ok {
		return obj{"anyOf": s["anyOf"], "description": d}
	}
	out := obj{}
	for k, v := range s {
		out[k] = v
	}
	if old, ok := out["description"].(string); ok {
		d = d + "\n\n" + old
	}
	out["description"] = d
	return out
}

func fieldSchema(f *protogen.Field) obj {
	if f.Desc.IsMap() {
		return obj{"type": "object", "additionalProperties": scalar(f.Message.Fields[1])}
	}
	s := scalar(f)
	switch {
	case f.Desc.IsList():
		return obj{"type": "array", "items": s}
	case f.Message != nil:
		return nullable(s)
	}
	return s
}

// nullable lets a message field be null, as answers write a message
// field that is not set (the server's JSON emits every field).
func nullable(s obj) obj {
	if t, ok := s["type"].(string); ok {
		out := obj{}
		for k, v := range s {
			out[k] = v
		}
		out["type"] = []string{t, "null"}
		return out
	}
	return obj{"anyOf": []obj{s, {"type": "null"}}}
}

func scalar(f *protogen.Field) obj {
	switch f.Desc.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return ref(f.Message.Desc.FullName())
	case protoreflect.EnumKind:
		return ref(f.Enum.Desc.FullName())
	case protoreflect.StringKind:
		return obj{"type": "string"}
	case protoreflect.BytesKind:
		return obj{"type": "string", "contentEncoding": "base64", "description": "Bytes, base64 (standard alphabet, padded)."}
	case protoreflect.BoolKind:
		return obj{"type": "boolean"}
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return obj{"type": "integer", "format": "int32"}
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return obj{"type": "integer", "format": "int32", "minimum": 0}
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return obj{"type": "string", "format": "int64", "pattern": "^-?[0-9]+$", "description": "A 64-bit integer, as a decimal string (a JSON number is accepted)."}
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return obj{"type": "string", "format": "uint64", "pattern": "^[0-9]+$", "description": "A 64-bit unsigned integer, as a decimal string (a JSON number is accepted)."}
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		return obj{"type": "number"}
	}
	panic(fmt.Sprintf("%s: unmapped kind %v", f.Desc.FullName(), f.Desc.Kind()))
}

func enumSchema(e *protogen.Enum) obj {
	var names []string
	var lines []string
	for _, v := range e.Values {
		names = append(names, string(v.Desc.Name()))
		if c := comment(v.Comments.Leading); c != "" {
			lines = append(lines, "- "+string(v.Desc.Name())+": "+strings.ReplaceAll(c, "\n", " "))
		}
	}
	desc := comment(e.Comments.Leading)
	if len(lines) > 0 {
		desc = strings.TrimSpace(desc + "\n\n" + strings.Join(lines, "\n"))
	}
	s := obj{"type": "string", "enum": names}
	if desc != "" {
		s["description"] = desc
	}
	return s
}

// comment is a leading comment as text: one space of each line's
// indentation dropped, lines kept.
func comment(c protogen.Comments) string {
	lines := strings.Split(strings.TrimRight(string(c), "\n"), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimPrefix(l, " ")
	}
	return strings.TrimSpace(strings.Join(lines, "\n"))
}

// connectError is the Connect protocol's error body, which the HTTP side
// answers every error with (connectrpc.com/connect's wire error).
func connectError() obj {
	return obj{
		"type":        "object",
		"description": "An error, as the Connect protocol writes it. code is the gRPC code's name in snake case; details are the gRPC status's details.",
		"properties": obj{
			"code": obj{"type": "string", "enum": []string{"canceled", "unknown", "invalid_argument", "deadline_exceeded", "not_found", "already_exists",
				"permission_denied", "resource_exhausted", "failed_precondition", "aborted", "out_of_range", "unimplemented", "internal", "unavailable",
				"data_loss", "unauthenticated"}},
			"message": obj{"type": "string"},
			"details": obj{"type": "array", "items": obj{
				"type": "object",
				"properties": obj{
					"type":  obj{"type": "string", "description": "The detail's full message name, without a type URL prefix.", "example": "google.rpc.ErrorInfo"},
					"value": obj{"type": "string", "contentEncoding": "base64", "description": "The detail in protobuf's binary form, base64 (unpadded)."},
					"debug": obj{"type": "object", "description": "The same detail as JSON, for people (informative: decode value)."},
				},
				"required": []string{"type", "value"},
			}},
		},
		"required": []string{"code"},
		"example": obj{
			"code":    "failed_precondition",
			"message": "the token is not the record's current token: another holder took over the key",
			"details": []obj{{
				"type":  "google.rpc.ErrorInfo",
				"value": "CgpMRUFTRV9MT1NUEgtpZGVtcmVnLmRldhocCghjb25zdW1lchIQYmlsbGluZy5wYXltZW50cxoUCgRraW5kEgxLSU5EX01FU1NBR0UaDgoDa2V5Egdtc2ctZXJy",
				"debug": obj{"reason": "LEASE_LOST", "domain": "idemreg.dev", "metadata": obj{"consumer": "billing.payments", "kind": "KIND_MESSAGE", "key": "msg-err"}},
			}},
		},
	}
}
