package kvm

import (
	"testing"

	"go.uber.org/goleak"
)

// Every connection, keepalive, abandoned RPC and SSH server goroutine ends
// with its test.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
