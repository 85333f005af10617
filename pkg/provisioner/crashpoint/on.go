//go:build crashpoints

package crashpoint

import (
	"context"
	"encoding/json"
	"os"
)

var armed = os.Getenv(Env)

// After marks the end of step: what it made is on the backend, the next
// step has not begun. Armed at step, it announces it and blocks for good.
func After(_ context.Context, step string) {
	if step == armed {
		announce(step)
		halt()
	}
}

// During marks the start of step, whose work runs on while the process
// can be killed (a call the backend carries out after its client is
// gone). Armed at step, it announces it; the returned func, called once
// that work returns, blocks for good. Unarmed, it returns a no-op.
func During(_ context.Context, step string) func() {
	if step != armed {
		return func() {}
	}
	announce(step)
	return halt
}

func announce(step string) {
	line, _ := json.Marshal(map[string]string{"level": "WARN", "msg": Msg, "step": step})
	// One write of one line: it cannot interleave with the log's lines.
	_, _ = os.Stderr.Write(append(line, '\n'))
}

// halt stops the operation where it is; the goroutine waits for the kill.
func halt() { select {} }
