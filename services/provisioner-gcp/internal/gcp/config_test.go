package gcp

import (
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/providers"
)

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	base := `providers:
  - name: gce
    type: gcp
    gcp:
      project: egress-test
      zones: [europe-west1-b]
      machineTypes: [e2-small]
      images: {debian-13: projects/debian-cloud/global/images/family/debian-13}
`
	tests := []struct {
		name, extra, want string
	}{
		{"valid", "", ""},
		{"unknown key", "      zonez: [x]\n", "providers[0].gcp.zonez: unknown field"},
		{"nested unknown key", "      serviceAccount: {email: a@b.iam.gserviceaccount.com, scope: [x]}\n", "providers[0].gcp.serviceAccount.scope: unknown field"},
		{"bad subnetwork", "      subnetwork: default\n", "subnetwork \"default\""},
		{"internal without external", "      externalIP: false\n      address: external\n", "address external needs externalIP: true"},
		{"both scheduling", "      spot: true\n      preemptible: true\n", "preemptible and spot"},
		{"own label", "      labels: {proxy-operator-uid: x}\n", "labels.proxy-operator-uid"},
		{"bad label", "      labels: {Team: x}\n", "labels.Team"},
		{"disk", "      diskSizeGb: 5\n", "diskSizeGb 5"},
		{"no auth without endpoint", "      withoutAuthentication: true\n", "withoutAuthentication needs endpoint"},
		{"endpoint", "      endpoint: ftp://x\n", "endpoint \"ftp://x\""},
		{"wait", "      operationWaitSeconds: 601\n", "operationWaitSeconds 601"},
		{"tag", "      networkTags: [Bad_Tag]\n", "networkTags[0]"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := providers.Parse([]byte(base + tc.extra))
			if err != nil {
				t.Fatal(err)
			}
			p, _ := cfg.Get("gce")
			_, err = FromProvider(p, nil, Options{})
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("valid config refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("error %v, want %q", err, tc.want)
			}
		})
	}
	// Missing required fields are all named at once.
	_, err := New("gce", Config{}, nil, Options{})
	for _, want := range []string{"project is required", "zones: at least one", "machineTypes: at least one", "images: at least one"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("empty config: %v lacks %q", err, want)
		}
	}
}
