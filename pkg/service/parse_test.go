package service

import (
	"bytes"
	"flag"
	"strings"
	"testing"
)

// A renamed flag, given as a flag or through its old variable, is refused
// with its new name rather than ignored.
func TestParseRefusesRenamedFlags(t *testing.T) {
	cases := []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
	}{
		{name: "new name", args: []string{"--migrate=false"}},
		{name: "old flag", args: []string{"--auto-migrate=false"}, wantErr: "--auto-migrate was renamed: use --migrate (EGRESS_MIGRATE)"},
		{name: "old flag, one dash, no value", args: []string{"-auto-migrate"}, wantErr: "use --migrate"},
		{name: "old variable", env: map[string]string{"EGRESS_AUTO_MIGRATE": "false"}, wantErr: "EGRESS_AUTO_MIGRATE is no longer read: the flag is --migrate now (EGRESS_MIGRATE)"},
		{name: "old REST variable", env: map[string]string{"EGRESS_GATEWAY_CA_FILE": "/ca.pem"}, wantErr: "the flag is --rest-ca-file now"},
		{name: "after --, an argument", args: []string{"--", "--auto-migrate"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			var out bytes.Buffer
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			fs.SetOutput(&out)
			migrate := fs.Bool("migrate", true, "")
			fs.String("rest-ca-file", "", "")
			err := Parse(fs, tc.args)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one with %q", err, tc.wantErr)
			}
			if !strings.Contains(out.String(), tc.wantErr) {
				t.Fatalf("the error is not printed: %q", out.String())
			}
			if !*migrate {
				t.Fatal("flags were parsed despite the error")
			}
		})
	}
}
