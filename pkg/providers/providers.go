// Package providers loads the providers config: one YAML file naming every
// backend the suite provisions on.
//
//	providers:
//	  - name: pve-home          # what Proxy.spec.provider refers to
//	    type: proxmox           # proxmox, kvm, gcp, kubernetes, local or sim
//	    proxmox: { ... }        # the backend block, keyed by the type
//
// The orchestrator and health need only names and types; each provisioner
// decodes its own provider's backend block with DecodeBackend. Unknown keys
// anywhere are rejected with their path (providers[0].proxmox.tokenFlie).
package providers

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"regexp"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Types are the backend types the suite knows.
var Types = []string{"proxmox", "kvm", "gcp", "kubernetes", "local", "sim"}

// Config is the parsed providers file.
type Config struct {
	Providers []Provider
}

// Provider is one configured provider.
type Provider struct {
	// Name is unique, a DNS label; it appears in NATS subjects and metrics.
	Name string
	// Type is one of Types.
	Type string
	// Path is the provider's position in the file, for error messages.
	Path string

	backend *yaml.Node
}

// Get returns the provider named name.
func (c *Config) Get(name string) (Provider, bool) {
	for _, p := range c.Providers {
		if p.Name == name {
			return p, true
		}
	}
	return Provider{}, false
}

// Names lists the provider names in file order.
func (c *Config) Names() []string {
	out := make([]string, len(c.Providers))
	for i, p := range c.Providers {
		out[i] = p.Name
	}
	return out
}

// LoadFile reads and validates the providers file at path.
func LoadFile(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("providers config: %w", err)
	}
	cfg, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("providers config %s: %w", path, err)
	}
	return cfg, nil
}

var nameRE = regexp.MustCompile(`^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$`)

// Parse validates a providers document.
func Parse(data []byte) (*Config, error) {
	var doc yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, errors.New("empty document: want a providers list")
		}
		return nil, fmt.Errorf("not YAML: %w", err)
	}
	if len(doc.Content) == 0 {
		return nil, errors.New("empty document: want a providers list")
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, errors.New("want a mapping with a providers list at the top")
	}
	var list *yaml.Node
	for i := 0; i+1 < len(root.Content); i += 2 {
		switch k := root.Content[i].Value; k {
		case "providers":
			list = root.Content[i+1]
		default:
			return nil, fmt.Errorf("%s: unknown field (line %d)", k, root.Content[i].Line)
		}
	}
	if list == nil || list.Kind != yaml.SequenceNode {
		return nil, errors.New("providers: want a list")
	}
	cfg := &Config{}
	seen := map[string]string{}
	for i, item := range list.Content {
		path := fmt.Sprintf("providers[%d]", i)
		p, err := parseProvider(item, path)
		if err != nil {
			return nil, err
		}
		if prev, dup := seen[p.Name]; dup {
			return nil, fmt.Errorf("%s.name: %q is already used by %s", path, p.Name, prev)
		}
		seen[p.Name] = path
		cfg.Providers = append(cfg.Providers, p)
	}
	return cfg, nil
}

func parseProvider(item *yaml.Node, path string) (Provider, error) {
	p := Provider{Path: path}
	if item.Kind != yaml.MappingNode {
		return p, fmt.Errorf("%s: want a mapping (line %d)", path, item.Line)
	}
	blocks := map[string]*yaml.Node{}
	for i := 0; i+1 < len(item.Content); i += 2 {
		key, val := item.Content[i], item.Content[i+1]
		switch {
		case key.Value == "name":
			p.Name = val.Value
		case key.Value == "type":
			p.Type = val.Value
		case isType(key.Value):
			blocks[key.Value] = val
		default:
			return p, fmt.Errorf("%s.%s: unknown field (line %d)", path, key.Value, key.Line)
		}
	}
	if !nameRE.MatchString(p.Name) {
		return p, fmt.Errorf("%s.name: %q must be a DNS label: lowercase letters, digits and '-', starting with a letter, at most 63 characters", path, p.Name)
	}
	if !isType(p.Type) {
		return p, fmt.Errorf("%s.type: %q is not one of %s", path, p.Type, strings.Join(Types, ", "))
	}
	for t := range blocks {
		if t != p.Type {
			return p, fmt.Errorf("%s.%s: a %s provider takes a %s block, not %s", path, t, p.Type, p.Type, t)
		}
	}
	p.backend = blocks[p.Type]
	return p, nil
}

func isType(s string) bool {
	for _, t := range Types {
		if s == t {
			return true
		}
	}
	return false
}

// Same reports whether q is p unchanged: the same name, type and backend
// block (its position in the file aside).
func (p Provider) Same(q Provider) bool {
	if p.Name != q.Name || p.Type != q.Type || (p.backend == nil) != (q.backend == nil) {
		return false
	}
	if p.backend == nil {
		return true
	}
	a, errA := yaml.Marshal(p.backend)
	b, errB := yaml.Marshal(q.backend)
	return errA == nil && errB == nil && bytes.Equal(a, b)
}

// DecodeBackend decodes the provider's backend block into into (a pointer to
// a struct with yaml tags). Unknown keys are errors naming their path. A
// provider without a block decodes nothing and leaves into as it is.
func (p Provider) DecodeBackend(into any) error {
	if p.backend == nil {
		return nil
	}
	t := reflect.TypeOf(into)
	if t == nil || t.Kind() != reflect.Pointer {
		return errors.New("DecodeBackend needs a pointer")
	}
	path := p.Path + "." + p.Type
	if err := checkKnownFields(p.backend, t.Elem(), path); err != nil {
		return err
	}
	if err := p.backend.Decode(into); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// checkKnownFields walks node along type t and reports the first key that t
// has no field for, with its path.
func checkKnownFields(node *yaml.Node, t reflect.Type, path string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if node.Kind == yaml.AliasNode && node.Alias != nil {
		node = node.Alias
	}
	switch t.Kind() {
	case reflect.Struct:
		if node.Kind != yaml.MappingNode {
			return nil // the decoder reports the type mismatch
		}
		fields := yamlFields(t)
		for i := 0; i+1 < len(node.Content); i += 2 {
			key := node.Content[i].Value
			ft, ok := fields[key]
			if !ok {
				return fmt.Errorf("%s.%s: unknown field (line %d)", path, key, node.Content[i].Line)
			}
			if err := checkKnownFields(node.Content[i+1], ft, path+"."+key); err != nil {
				return err
			}
		}
	case reflect.Slice, reflect.Array:
		if node.Kind != yaml.SequenceNode {
			return nil
		}
		for i, el := range node.Content {
			if err := checkKnownFields(el, t.Elem(), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	case reflect.Map:
		if node.Kind != yaml.MappingNode {
			return nil
		}
		for i := 0; i+1 < len(node.Content); i += 2 {
			if err := checkKnownFields(node.Content[i+1], t.Elem(), path+"."+node.Content[i].Value); err != nil {
				return err
			}
		}
	}
	return nil
}

// yamlFields maps the yaml keys of struct t (inline structs flattened) to
// their field types.
func yamlFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		tag := f.Tag.Get("yaml")
		name, opts, _ := strings.Cut(tag, ",")
		if name == "-" {
			continue
		}
		if strings.Contains(opts, "inline") {
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			for k, v := range yamlFields(ft) {
				out[k] = v
			}
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		out[name] = f.Type
	}
	return out
}
