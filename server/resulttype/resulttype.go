// Package resulttype owns the message types the registry can know a
// stored response by: those linked into the binary (protoregistry's
// GlobalTypes, the google.protobuf well-known types among them) and those
// of a descriptor set an operator gives. An operator's resolution stores
// bytes that every later Claim replays and decodes as the response's type;
// with the type known, the bytes are checked before they are stored, and
// can be written as JSON and encoded here. The AdminService, the console
// and `idemreg admin resolve` share it, so that they agree on what is
// known and on what decodes.
package resulttype

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// ErrUnknownType is returned by Encode for a type that is neither linked
// nor in the descriptor set.
var ErrUnknownType = errors.New("unknown message type")

// Types resolves message types by name: first those of the descriptor set
// it was built from, then those linked into the binary. The set comes
// first because it is the operator's statement of what the services' types
// are now, while a linked type of the same name may be an older copy. A
// nil *Types knows the linked types only.
type Types struct {
	set *dynamicpb.Types // nil without a descriptor set
}

// wrappers are the well-known types whose JSON is their one field's.
var wrappers = map[protoreflect.FullName]bool{
	"google.protobuf.DoubleValue": true, "google.protobuf.FloatValue": true,
	"google.protobuf.Int64Value": true, "google.protobuf.UInt64Value": true,
	"google.protobuf.Int32Value": true, "google.protobuf.UInt32Value": true,
	"google.protobuf.BoolValue": true, "google.protobuf.StringValue": true,
	"google.protobuf.BytesValue": true,
}

// Linked knows the types linked into the binary only.
func Linked() *Types { return nil }

// Load reads a binary FileDescriptorSet (what `buf build -o FILE.binpb` and
// `protoc --descriptor_set_out=FILE` write) and returns the types it
// defines beside the linked ones. An empty path is Linked.
func Load(path string) (*Types, error) {
	if path == "" {
		return Linked(), nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("descriptor set: %w", err)
	}
	var set descriptorpb.FileDescriptorSet
	if err := proto.Unmarshal(b, &set); err != nil {
		return nil, fmt.Errorf("descriptor set %s is not a binary FileDescriptorSet (buf build -o FILE.binpb, protoc --descriptor_set_out=FILE): %w", path, err)
	}
	t, err := FromSet(&set)
	if err != nil {
		return nil, fmt.Errorf("descriptor set %s: %w", path, err)
	}
	return t, nil
}

// FromSet returns the types of set beside the linked ones. The set may
// leave out the files it imports that are linked into the binary (protoc
// without --include_imports leaves out google/protobuf/timestamp.proto):
// those are taken from the binary.
func FromSet(set *descriptorpb.FileDescriptorSet) (*Types, error) {
	files := set.GetFile()
	have := make(map[string]bool, len(files))
	for _, f := range files {
		have[f.GetName()] = true
	}
	for i := 0; i < len(files); i++ { // files grows as imports are added
		for _, dep := range files[i].GetDependency() {
			if have[dep] {
				continue
			}
			fd, err := protoregistry.GlobalFiles.FindFileByPath(dep)
			if err != nil {
				return nil, fmt.Errorf("%s imports %s, which is neither in the set nor linked into the binary: build the set with its imports (buf build does; protoc needs --include_imports)",
					files[i].GetName(), dep)
			}
			have[dep] = true
			files = append(files, protodesc.ToFileDescriptorProto(fd))
		}
	}
	reg, err := protodesc.NewFiles(&descriptorpb.FileDescriptorSet{File: files})
	if err != nil {
		return nil, err
	}
	return &Types{set: dynamicpb.NewTypes(reg)}, nil
}

// Find returns the message type named name (a full name, such as
// "google.protobuf.Int64Value"), and false when it is not known.
func (t *Types) Find(name string) (protoreflect.MessageType, bool) {
	mt, err := t.FindMessageByName(protoreflect.FullName(name))
	return mt, err == nil
}

// Check reports whether data decodes as the message type named name, as a
// Claim's caller decodes a replayed response (proto.Unmarshal, required
// fields checked). known is false, and err nil, when the type is not
// known: such bytes cannot be checked.
func (t *Types) Check(name string, data []byte) (known bool, err error) {
	mt, ok := t.Find(name)
	if !ok {
		return false, nil
	}
	return true, proto.UnmarshalOptions{Resolver: t}.Unmarshal(data, mt.New().Interface())
}

// Encode returns the wire format of the message of type name written as
// JSON in the protobuf JSON mapping: the bytes a service's own Complete
// would have stored. A wrapper (google.protobuf.Int64Value, ...) also
// takes the form of its message, {"value": X}. It returns ErrUnknownType
// when the type is not known.
func (t *Types) Encode(name, data string) ([]byte, error) {
	mt, ok := t.Find(name)
	if !ok {
		return nil, fmt.Errorf("%w %q", ErrUnknownType, name)
	}
	m := mt.New().Interface()
	err := (protojson.UnmarshalOptions{Resolver: t}).Unmarshal([]byte(data), m)
	if err != nil && wrappers[mt.Descriptor().FullName()] {
		// The JSON of a wrapper is its bare value ("10" for an
		// Int64Value), while an operator who reads the .proto writes the
		// message {"value": "10"}; an object is never a wrapper's JSON,
		// so taking its one field is unambiguous.
		var obj map[string]json.RawMessage
		if json.Unmarshal([]byte(data), &obj) == nil && len(obj) == 1 && obj["value"] != nil {
			proto.Reset(m)
			if protojson.Unmarshal(obj["value"], m) == nil {
				err = nil
			}
		}
	}
	if err != nil {
		return nil, err
	}
	// Deterministic, as the server encodes results: the same JSON gives
	// the same bytes.
	return proto.MarshalOptions{Deterministic: true}.Marshal(m)
}

// FindMessageByName implements protoregistry.MessageTypeResolver, so that
// an Any inside a response resolves against the same types.
func (t *Types) FindMessageByName(name protoreflect.FullName) (protoreflect.MessageType, error) {
	if t != nil && t.set != nil {
		if mt, err := t.set.FindMessageByName(name); err == nil {
			return mt, nil
		}
	}
	return protoregistry.GlobalTypes.FindMessageByName(name)
}

// FindMessageByURL implements protoregistry.MessageTypeResolver.
func (t *Types) FindMessageByURL(url string) (protoreflect.MessageType, error) {
	if t != nil && t.set != nil {
		if mt, err := t.set.FindMessageByURL(url); err == nil {
			return mt, nil
		}
	}
	return protoregistry.GlobalTypes.FindMessageByURL(url)
}

// FindExtensionByName implements protoregistry.ExtensionTypeResolver.
func (t *Types) FindExtensionByName(name protoreflect.FullName) (protoreflect.ExtensionType, error) {
	if t != nil && t.set != nil {
		if xt, err := t.set.FindExtensionByName(name); err == nil {
			return xt, nil
		}
	}
	return protoregistry.GlobalTypes.FindExtensionByName(name)
}

// FindExtensionByNumber implements protoregistry.ExtensionTypeResolver.
func (t *Types) FindExtensionByNumber(message protoreflect.FullName, field protoreflect.FieldNumber) (protoreflect.ExtensionType, error) {
	if t != nil && t.set != nil {
		if xt, err := t.set.FindExtensionByNumber(message, field); err == nil {
			return xt, nil
		}
	}
	return protoregistry.GlobalTypes.FindExtensionByNumber(message, field)
}
