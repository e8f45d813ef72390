package main

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

// TestProto3IsTheSameAPI rewrites the API's files as the plugin does and
// checks that every field keeps its wire type, cardinality, packing and
// presence, and every enum its openness: the Python runtime then encodes
// and decodes what the Go one does.
func TestProto3IsTheSameAPI(t *testing.T) {
	for _, fd := range []protoreflect.FileDescriptor{
		idemregv1.File_idemreg_v1_registry_proto,
		idemregv1.File_idemreg_v1_admin_proto,
		idemregv1.File_idemreg_v1_error_reason_proto,
	} {
		t.Run(fd.Path(), func(t *testing.T) {
			converted, err := asProto3(protodesc.ToFileDescriptorProto(fd))
			if err != nil {
				t.Fatal(err)
			}
			if converted.GetSyntax() != "proto3" || converted.Edition != nil {
				t.Fatalf("syntax %q, edition %v", converted.GetSyntax(), converted.GetEdition())
			}
			if strings.Contains(converted.String(), "features") {
				t.Fatalf("features left in %s", converted)
			}
			got, err := protodesc.NewFile(converted, protoregistry.GlobalFiles)
			if err != nil {
				t.Fatal(err)
			}
			sameMessages(t, fd.Messages(), got.Messages())
			sameEnums(t, fd.Enums(), got.Enums())
		})
	}
}

func sameMessages(t *testing.T, want, got protoreflect.MessageDescriptors) {
	t.Helper()
	if want.Len() != got.Len() {
		t.Fatalf("%d messages, want %d", got.Len(), want.Len())
	}
	for i := range want.Len() {
		w, g := want.Get(i), got.Get(i)
		for j := range w.Fields().Len() {
			wf, gf := w.Fields().Get(j), g.Fields().Get(j)
			if wf.FullName() != gf.FullName() || wf.Number() != gf.Number() || wf.Kind() != gf.Kind() ||
				wf.Cardinality() != gf.Cardinality() || wf.IsPacked() != gf.IsPacked() ||
				wf.HasPresence() != gf.HasPresence() || (wf.ContainingOneof() == nil) != (gf.ContainingOneof() == nil) {
				t.Errorf("%s: kind %v/%v, cardinality %v/%v, packed %v/%v, presence %v/%v", wf.FullName(),
					gf.Kind(), wf.Kind(), gf.Cardinality(), wf.Cardinality(), gf.IsPacked(), wf.IsPacked(), gf.HasPresence(), wf.HasPresence())
			}
		}
		sameMessages(t, w.Messages(), g.Messages())
		sameEnums(t, w.Enums(), g.Enums())
	}
}

func sameEnums(t *testing.T, want, got protoreflect.EnumDescriptors) {
	t.Helper()
	for i := range want.Len() {
		if want.Get(i).IsClosed() != got.Get(i).IsClosed() || want.Get(i).Values().Len() != got.Get(i).Values().Len() {
			t.Errorf("%s: closed %v, want %v", want.Get(i).FullName(), got.Get(i).IsClosed(), want.Get(i).IsClosed())
		}
	}
}

// TestRefusesWhatProto3CannotSay: a scalar with explicit presence, a
// closed enum or a delimited message would change the wire format or the
// API if written as proto3.
func TestRefusesWhatProto3CannotSay(t *testing.T) {
	base := func(field *descriptorpb.FieldDescriptorProto, fileFeatures *descriptorpb.FeatureSet) *descriptorpb.FileDescriptorProto {
		return &descriptorpb.FileDescriptorProto{
			Name: proto.String("x.proto"), Package: proto.String("x"),
			Syntax: proto.String("editions"), Edition: descriptorpb.Edition_EDITION_2023.Enum(),
			Options: &descriptorpb.FileOptions{Features: fileFeatures},
			MessageType: []*descriptorpb.DescriptorProto{{
				Name: proto.String("M"), Field: []*descriptorpb.FieldDescriptorProto{field},
			}},
		}
	}
	scalar := func(fs *descriptorpb.FeatureSet) *descriptorpb.FieldDescriptorProto {
		f := &descriptorpb.FieldDescriptorProto{
			Name: proto.String("s"), Number: proto.Int32(1),
			Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(),
		}
		if fs != nil {
			f.Options = &descriptorpb.FieldOptions{Features: fs}
		}
		return f
	}
	implicit := &descriptorpb.FeatureSet{FieldPresence: descriptorpb.FeatureSet_IMPLICIT.Enum()}
	for _, c := range []struct {
		name string
		fd   *descriptorpb.FileDescriptorProto
		want string
	}{
		{"edition 2023's default presence", base(scalar(nil), nil), "explicit presence"},
		{"explicit on one field", base(scalar(&descriptorpb.FeatureSet{FieldPresence: descriptorpb.FeatureSet_EXPLICIT.Enum()}), implicit), "explicit presence"},
		{"a closed enum", base(scalar(nil), &descriptorpb.FeatureSet{FieldPresence: descriptorpb.FeatureSet_IMPLICIT.Enum(), EnumType: descriptorpb.FeatureSet_CLOSED.Enum()}), "closed enums"},
		{"delimited", base(scalar(&descriptorpb.FeatureSet{MessageEncoding: descriptorpb.FeatureSet_DELIMITED.Enum()}), implicit), "delimited"},
		{"implicit is fine", base(scalar(nil), implicit), ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := asProto3(c.fd)
			if c.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("asProto3: %v; want an error with %q", err, c.want)
			}
		})
	}
}
