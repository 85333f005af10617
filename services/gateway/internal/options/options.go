// Package options parses the options a crawler puts in the username of its
// proxy credentials (HTTP Proxy-Authorization or SOCKS5 user/password).
//
// The grammar is one list of options separated by commas, each option a key
// and a value joined by the first hyphen:
//
//	username = "" | option *( "," option )
//	option   = key "-" value
//	key      = "session" | "pool" | "provider" | "region" | "zone" | "label" | "lifetime"
//
// For example `session-cart42,pool-web,label-market=eu,lifetime-10m`. Each
// key appears at most once, except label, which may repeat (one
// key=value selector each). An empty username sets no option. An unknown
// key, a repeated key or a malformed value is refused with an error naming
// the option; nothing is ever ignored.
package options

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
)

// Options are what one username asks of the gateway.
type Options struct {
	// Session is the session id; empty: every request or tunnel picks a
	// proxy of its own.
	Session string
	// Pool, Provider, Region, Zone and Labels select the proxies, as the
	// lease service's ProxySelector does.
	Pool     string
	Provider string
	Region   string
	Zone     string
	Labels   map[string]string
	// Lifetime is how long the session lives after its last request; zero:
	// the gateway's default.
	Lifetime time.Duration
}

// Error is a refused option: Option is the text of the option as given
// (truncated), Reason why it was refused.
type Error struct {
	Option string
	Reason string
}

func (e *Error) Error() string {
	return fmt.Sprintf("username option %q: %s", e.Option, e.Reason)
}

// Limits bound what Parse accepts.
const (
	// MaxUsername is the longest username accepted, in bytes (SOCKS5 allows
	// 255).
	MaxUsername = 255
	// MinLifetime and MaxLifetime bound the lifetime option.
	MinLifetime = 10 * time.Second
	MaxLifetime = time.Hour
	maxLabels   = 16
)

var (
	sessionRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)
	poolRE    = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,54}[a-z0-9])?$`)
	placeRE   = regexp.MustCompile(`^[A-Za-z0-9._-]{1,63}$`)
	labelKRE  = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$`)
	labelVRE  = regexp.MustCompile(`^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$`)
)

// Keys lists the option keys, in the order the documentation gives them.
var Keys = []string{"session", "pool", "provider", "region", "zone", "label", "lifetime"}

// Parse parses a username.
func Parse(username string) (Options, error) {
	var o Options
	if username == "" {
		return o, nil
	}
	if len(username) > MaxUsername {
		return o, &Error{Option: clip(username), Reason: fmt.Sprintf("the username is longer than %d bytes", MaxUsername)}
	}
	seen := map[string]bool{}
	for _, opt := range strings.Split(username, ",") {
		key, value, ok := strings.Cut(opt, "-")
		switch {
		case opt == "":
			return o, &Error{Option: opt, Reason: "empty option (two commas in a row, or a comma at an end)"}
		case !ok:
			return o, &Error{Option: clip(opt), Reason: "want key-value, with key one of " + strings.Join(Keys, ", ")}
		case value == "":
			return o, &Error{Option: clip(opt), Reason: "empty value"}
		}
		if seen[key] && key != "label" {
			return o, &Error{Option: clip(opt), Reason: "option " + key + " is given twice"}
		}
		seen[key] = true
		if err := o.set(key, value); err != nil {
			return o, &Error{Option: clip(opt), Reason: err.Error()}
		}
	}
	return o, nil
}

func (o *Options) set(key, value string) error {
	switch key {
	case "session":
		if !sessionRE.MatchString(value) {
			return errors.New("a session id is 1 to 64 letters, digits, '.', '_' or '-'")
		}
		o.Session = value
	case "pool":
		if !poolRE.MatchString(value) {
			return errors.New("a pool name is lowercase letters, digits and '-', starting with a letter, at most 56 characters")
		}
		o.Pool = value
	case "provider", "region", "zone":
		if !placeRE.MatchString(value) {
			return fmt.Errorf("a %s is 1 to 63 letters, digits, '.', '_' or '-'", key)
		}
		switch key {
		case "provider":
			o.Provider = value
		case "region":
			o.Region = value
		default:
			o.Zone = value
		}
	case "label":
		k, v, ok := strings.Cut(value, "=")
		switch {
		case !ok:
			return errors.New("want label-key=value")
		case !labelKRE.MatchString(k):
			return fmt.Errorf("label key %q is not a valid label key", clip(k))
		case !labelVRE.MatchString(v):
			return fmt.Errorf("label value %q is not a valid label value", clip(v))
		}
		if o.Labels == nil {
			o.Labels = map[string]string{}
		}
		if _, dup := o.Labels[k]; dup {
			return fmt.Errorf("label %s is given twice", k)
		}
		if len(o.Labels) == maxLabels {
			return fmt.Errorf("at most %d labels", maxLabels)
		}
		o.Labels[k] = v
	case "lifetime":
		d, err := time.ParseDuration(value)
		if err != nil {
			return errors.New("want a duration such as 90s, 10m or 1h")
		}
		if d < MinLifetime || d > MaxLifetime {
			return fmt.Errorf("a lifetime lies between %s and %s", MinLifetime, MaxLifetime)
		}
		o.Lifetime = d
	default:
		return errors.New("unknown option " + strings.ToValidUTF8(clip(key), "?") + "; the options are " + strings.Join(Keys, ", "))
	}
	return nil
}

// clip shortens what is echoed back in an error.
func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// SessionKey is the lease service's session key of a client's session:
// the gateway's leases all belong to the gateway's own client id, so the
// crawler's client id is part of the key. Empty when no session was asked
// for.
func SessionKey(clientID, session string) string {
	if session == "" {
		return ""
	}
	key := "gw/" + clientID + "/" + session
	if len(key) > maxSessionKey {
		sum := sha256.Sum256([]byte(clientID))
		key = "gw/" + hex.EncodeToString(sum[:16]) + "/" + session
	}
	return key
}

// maxSessionKey is the longest session key the lease service accepts.
const maxSessionKey = 128
