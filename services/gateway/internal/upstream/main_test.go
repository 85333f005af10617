package upstream

import (
	"testing"

	"go.uber.org/goleak"
)

// The reservoir and the fleet view start goroutines (renewals, acquires
// ahead, releases): none outlives a test.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
