package store_test

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

func TestMain(m *testing.M) { orchtest.Main(m) }
