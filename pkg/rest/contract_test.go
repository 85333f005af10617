package rest

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// contractPackages are the proto packages of the suite; every message in
// them is round-tripped.
var contractPackages = []protoreflect.FullName{
	"egress.proxy.v1", "egress.provisioner.v1", "egress.lease.v1", "egress.health.v1", "egress.bus.v1",
}

// TestContractMessagesRoundTrip fills every field of every contract message
// (one variant per member of its largest oneof) and checks that the message
// survives the protobuf binary encoding and the REST layer's JSON encoding.
func TestContractMessagesRoundTrip(t *testing.T) {
	t.Parallel()
	var messages []protoreflect.MessageDescriptor
	for _, pkg := range contractPackages {
		n := 0
		protoregistry.GlobalFiles.RangeFilesByPackage(pkg, func(fd protoreflect.FileDescriptor) bool {
			collectMessages(fd.Messages(), &messages)
			n++
			return true
		})
		if n == 0 {
			t.Fatalf("package %s has no registered files", pkg)
		}
	}
	if len(messages) < 40 {
		t.Fatalf("found only %d messages; the registry walk is broken", len(messages))
	}
	m := Marshaler()
	for _, md := range messages {
		for variant := range variants(md) {
			name := string(md.FullName())
			t.Run(name, func(t *testing.T) {
				mt, err := protoregistry.GlobalTypes.FindMessageByName(md.FullName())
				if err != nil {
					t.Fatal(err)
				}
				orig := mt.New()
				fill(orig, variant, 0)
				if isEmpty(orig) && md.Fields().Len() > 0 {
					t.Fatal("fill left the message empty")
				}

				wire, err := proto.Marshal(orig.Interface())
				if err != nil {
					t.Fatal(err)
				}
				fromWire := mt.New().Interface()
				if err := proto.Unmarshal(wire, fromWire); err != nil {
					t.Fatal(err)
				}
				if !proto.Equal(orig.Interface(), fromWire) {
					t.Errorf("binary round trip changed the message")
				}

				js, err := m.Marshal(orig.Interface())
				if err != nil {
					t.Fatal(err)
				}
				fromJSON := mt.New().Interface()
				if err := m.Unmarshal(js, fromJSON); err != nil {
					t.Fatalf("unmarshal %s: %v", js, err)
				}
				if !proto.Equal(orig.Interface(), fromJSON) {
					t.Errorf("JSON round trip changed the message:\n%s", js)
				}
				assertCamelCaseKeys(t, md, string(js))
			})
		}
	}
}

func collectMessages(mds protoreflect.MessageDescriptors, out *[]protoreflect.MessageDescriptor) {
	for i := range mds.Len() {
		md := mds.Get(i)
		if md.IsMapEntry() {
			continue
		}
		*out = append(*out, md)
		collectMessages(md.Messages(), out)
	}
}

// variants yields 0..n-1 where n is the size of the message's largest oneof
// (at least 1), so every oneof member is exercised.
func variants(md protoreflect.MessageDescriptor) func(func(int) bool) {
	n := 1
	for i := range md.Oneofs().Len() {
		if o := md.Oneofs().Get(i); !o.IsSynthetic() && o.Fields().Len() > n {
			n = o.Fields().Len()
		}
	}
	return func(yield func(int) bool) {
		for i := range n {
			if !yield(i) {
				return
			}
		}
	}
}

// fill sets every field of m to a non-default value; for a real oneof only
// member variant (modulo its size). Recursion stops at depth 4.
func fill(m protoreflect.Message, variant, depth int) {
	md := m.Descriptor()
	switch md.FullName() {
	case "google.protobuf.Timestamp":
		m.Set(md.Fields().ByName("seconds"), protoreflect.ValueOfInt64(1_790_000_000))
		m.Set(md.Fields().ByName("nanos"), protoreflect.ValueOfInt32(123_000_000))
		return
	case "google.protobuf.Duration":
		m.Set(md.Fields().ByName("seconds"), protoreflect.ValueOfInt64(42))
		m.Set(md.Fields().ByName("nanos"), protoreflect.ValueOfInt32(500_000_000))
		return
	}
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if o := fd.ContainingOneof(); o != nil && !o.IsSynthetic() {
			if o.Fields().Get(variant%o.Fields().Len()) != fd {
				continue
			}
		}
		switch {
		case fd.IsMap():
			mp := m.Mutable(fd).Map()
			mp.Set(scalar(fd.MapKey(), 0).MapKey(), elem(m, fd, fd.MapValue(), variant, depth))
		case fd.IsList():
			l := m.Mutable(fd).List()
			for j := range 2 {
				if fd.Kind() == protoreflect.MessageKind {
					v := l.NewElement()
					if depth < 4 {
						fill(v.Message(), variant, depth+1)
					}
					l.Append(v)
				} else {
					l.Append(scalar(fd, j))
				}
			}
		case fd.Kind() == protoreflect.MessageKind:
			if depth < 4 {
				fill(m.Mutable(fd).Message(), variant, depth+1)
			}
		default:
			m.Set(fd, scalar(fd, 0))
		}
	}
}

func elem(parent protoreflect.Message, mapField, fd protoreflect.FieldDescriptor, variant, depth int) protoreflect.Value {
	if fd.Kind() == protoreflect.MessageKind {
		v := parent.NewField(mapField).Map().NewValue()
		if depth < 4 {
			fill(v.Message(), variant, depth+1)
		}
		return v
	}
	return scalar(fd, 1)
}

func scalar(fd protoreflect.FieldDescriptor, i int) protoreflect.Value {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.EnumKind:
		vals := fd.Enum().Values()
		return protoreflect.ValueOfEnum(vals.Get(vals.Len() - 1 - i%(vals.Len()-1)).Number())
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(int32(-7 - i))
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(int64(-1<<40 - i))
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(uint32(7 + i))
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(uint64(1<<40 + i))
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(1.5)
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(2.25)
	case protoreflect.StringKind:
		return protoreflect.ValueOfString(string(fd.Name()) + "-value-" + string(rune('a'+i)))
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte{0, 1, 2, byte(i)})
	}
	panic("unhandled kind " + fd.Kind().String())
}

func isEmpty(m protoreflect.Message) bool {
	empty := true
	m.Range(func(protoreflect.FieldDescriptor, protoreflect.Value) bool {
		empty = false
		return false
	})
	return empty
}

// assertCamelCaseKeys checks that no JSON key of md's fields is snake_case.
func assertCamelCaseKeys(t *testing.T, md protoreflect.MessageDescriptor, js string) {
	t.Helper()
	for i := range md.Fields().Len() {
		fd := md.Fields().Get(i)
		if strings.Contains(string(fd.Name()), "_") && strings.Contains(js, `"`+string(fd.Name())+`":`) {
			t.Errorf("field %s is encoded by its proto name, want %s", fd.Name(), fd.JSONName())
		}
	}
}
