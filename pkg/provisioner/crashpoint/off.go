//go:build !crashpoints

package crashpoint

import "context"

// After marks the end of step: what it made is on the backend, the next
// step has not begun. Armed at step, it announces it and blocks for good.
func After(context.Context, string) {}

// During marks the start of step, whose work runs on while the process
// can be killed (a call the backend carries out after its client is
// gone). Armed at step, it announces it; the returned func, called once
// that work returns, blocks for good. Unarmed, it returns a no-op.
func During(context.Context, string) func() { return nop }

func nop() {}
