// Command openapirules writes the contracts' buf.validate rules into the
// generated OpenAPI document, which protoc-gen-openapiv2 leaves without
// them: JSON-schema constraints where OpenAPI has one (maxLength,
// minLength, pattern, minimum, maximum, maxProperties, required) and a
// "Rules:" sentence in the description for every rule. `make generate`
// runs it after buf generate:
//
//	go run ./pkg/validate/openapirules pkg/api/openapi/egress.swagger.json
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"

	"buf.build/gen/go/bufbuild/protovalidate/protocolbuffers/go/buf/validate"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/gateway/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/identity/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	validatev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/validate/v1"
)

var services = []protoreflect.FullName{"egress.proxy.v1.ProxyService", "egress.proxy.v1.ProxyPoolService", "egress.lease.v1.LeaseService", "egress.health.v1.HealthService", "egress.identity.v1.IdentityService", "egress.gateway.v1.GatewayService"}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: openapirules <swagger.json>")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "openapirules:", err)
		os.Exit(1)
	}
}

type object = map[string]any

func run(path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var doc object
	if err := json.Unmarshal(raw, &doc); err != nil {
		return err
	}
	methods := map[string]protoreflect.MethodDescriptor{}
	for _, name := range services {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(name)
		if err != nil {
			return err
		}
		sd := d.(protoreflect.ServiceDescriptor)
		for i := range sd.Methods().Len() {
			m := sd.Methods().Get(i)
			methods[string(sd.Name())+"_"+string(m.Name())] = m
		}
	}
	defs, _ := doc["definitions"].(object)
	seen := map[string]protoreflect.MessageDescriptor{}
	paths, _ := doc["paths"].(object)
	for _, p := range sortedKeys(paths) {
		ops, _ := paths[p].(object)
		for _, verb := range sortedKeys(ops) {
			op, _ := ops[verb].(object)
			id, _ := op["operationId"].(string)
			m, ok := methods[id]
			if !ok {
				return fmt.Errorf("%s %s: operation %q is no known RPC", verb, p, id)
			}
			params, _ := op["parameters"].([]any)
			for _, x := range params {
				param, _ := x.(object)
				if param["in"] == "body" {
					schema, _ := param["schema"].(object)
					if ref, ok := schema["$ref"].(string); ok {
						mapDefinition(defs, strings.TrimPrefix(ref, "#/definitions/"), m.Input(), seen)
					}
					continue
				}
				name, _ := param["name"].(string)
				if fd := fieldByJSONPath(m.Input(), strings.TrimSuffix(name, "[string]")); fd != nil {
					apply(param, fd, strings.HasSuffix(name, "[string]"))
				}
			}
		}
	}
	for _, name := range sortedKeys(seen) {
		md := seen[name]
		def, _ := defs[name].(object)
		props, _ := def["properties"].(object)
		var required []any
		for _, jsonName := range sortedKeys(props) {
			fd := md.Fields().ByJSONName(jsonName)
			if fd == nil {
				continue
			}
			prop, _ := props[jsonName].(object)
			if apply(prop, fd, false) {
				required = append(required, jsonName)
			}
		}
		if len(required) > 0 {
			def["required"] = required
		}
	}
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(doc); err != nil {
		return err
	}
	return os.WriteFile(path, out.Bytes(), 0o644)
}

// mapDefinition records that definition name is message md (or the part of
// it a body carries), then follows its message-typed properties.
func mapDefinition(defs object, name string, md protoreflect.MessageDescriptor, seen map[string]protoreflect.MessageDescriptor) {
	if _, ok := seen[name]; ok {
		return
	}
	def, ok := defs[name].(object)
	if !ok {
		return
	}
	seen[name] = md
	props, _ := def["properties"].(object)
	for jsonName, x := range props {
		prop, _ := x.(object)
		ref, _ := prop["$ref"].(string)
		fd := md.Fields().ByJSONName(jsonName)
		if ref == "" || fd == nil || fd.Message() == nil {
			continue
		}
		mapDefinition(defs, strings.TrimPrefix(ref, "#/definitions/"), fd.Message(), seen)
	}
}

func fieldByJSONPath(md protoreflect.MessageDescriptor, path string) protoreflect.FieldDescriptor {
	var fd protoreflect.FieldDescriptor
	for _, part := range strings.Split(path, ".") {
		if md == nil {
			return nil
		}
		if fd = md.Fields().ByJSONName(part); fd == nil {
			return nil
		}
		md = fd.Message()
	}
	return fd
}

// apply writes fd's rules into the schema or parameter s; mapValue says s
// stands for the values of a map field. It reports whether fd is required.
func apply(s object, fd protoreflect.FieldDescriptor, mapValue bool) (required bool) {
	rules, _ := proto.GetExtension(fd.Options(), validate.E_Field).(*validate.FieldRules)
	if rules == nil {
		return false
	}
	var says []string
	if rules.GetRequired() {
		says = append(says, "required")
	}
	if mr := rules.GetMap(); mr != nil {
		if mr.HasMaxPairs() {
			if !mapValue {
				s["maxProperties"] = mr.GetMaxPairs()
			}
			says = append(says, fmt.Sprintf("at most %d entries", mr.GetMaxPairs()))
		}
		if k := stringRules(mr.GetKeys().GetString(), nil); len(k) > 0 {
			says = append(says, "keys: "+strings.Join(k, ", "))
		}
		target := s
		if !mapValue {
			target, _ = s["additionalProperties"].(object)
		}
		if v := stringRules(mr.GetValues().GetString(), target); len(v) > 0 {
			says = append(says, "values: "+strings.Join(v, ", "))
		}
	}
	says = append(says, stringRules(rules.GetString(), s)...)
	number := func(gte, lte *int64, gt bool) {
		if gte != nil {
			s["minimum"] = *gte
			if gt {
				s["exclusiveMinimum"] = true
				says = append(says, fmt.Sprintf("greater than %d", *gte))
			} else {
				says = append(says, fmt.Sprintf("at least %d", *gte))
			}
		}
		if lte != nil {
			s["maximum"] = *lte
			says = append(says, fmt.Sprintf("at most %d", *lte))
		}
	}
	if r := rules.GetInt32(); r != nil {
		number(ptr(r.HasGte(), int64(r.GetGte())), ptr(r.HasLte(), int64(r.GetLte())), false)
	}
	if r := rules.GetInt64(); r != nil {
		number(ptr(r.HasGte(), r.GetGte()), ptr(r.HasLte(), r.GetLte()), false)
	}
	if r := rules.GetUint32(); r != nil {
		number(ptr(r.HasGte(), int64(r.GetGte())), ptr(r.HasLte(), int64(r.GetLte())), false)
	}
	if r := rules.GetEnum(); r != nil && r.GetDefinedOnly() {
		says = append(says, "one of the defined values")
	}
	if r := rules.GetDuration(); r != nil {
		if r.HasGte() {
			says = append(says, "at least "+r.GetGte().AsDuration().String())
		}
		if r.HasGt() {
			says = append(says, "greater than "+r.GetGt().AsDuration().String())
		}
	}
	if len(says) > 0 {
		desc, _ := s["description"].(string)
		if desc != "" {
			desc += "\n\n"
		}
		s["description"] = desc + "Rules: " + strings.Join(says, "; ") + "."
	}
	return rules.GetRequired()
}

func ptr(ok bool, v int64) *int64 {
	if !ok {
		return nil
	}
	return &v
}

// stringRules describes r and, when s is not nil, sets the JSON-schema
// constraints it has.
func stringRules(r *validate.StringRules, s object) []string {
	if r == nil {
		return nil
	}
	set := func(k string, v any) {
		if s != nil {
			s[k] = v
		}
	}
	var says []string
	if r.HasMinLen() {
		set("minLength", r.GetMinLen())
		says = append(says, fmt.Sprintf("at least %d characters", r.GetMinLen()))
	}
	if r.HasMaxLen() {
		set("maxLength", r.GetMaxLen())
		says = append(says, fmt.Sprintf("at most %d characters", r.GetMaxLen()))
	}
	if r.HasMaxBytes() {
		says = append(says, fmt.Sprintf("at most %d bytes of UTF-8", r.GetMaxBytes()))
	}
	if r.HasPattern() {
		set("pattern", r.GetPattern())
		says = append(says, "matches "+r.GetPattern())
	}
	if r.GetUuid() {
		set("format", "uuid")
		says = append(says, "a UUID")
	}
	if v, _ := proto.GetExtension(r, validatev1.E_Printable).(bool); v {
		says = append(says, "printable text: no control characters (NUL, tab, CR, LF, DEL, C1), no invisible format characters, no line or paragraph separators")
	}
	if v, _ := proto.GetExtension(r, validatev1.E_MultilineText).(bool); v {
		says = append(says, "text: no control characters other than tab, LF and CR")
	}
	return says
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
