// Package crashpoint marks the steps of a backend operation after which a
// crash leaves something half made, so that a test can kill a real
// provisioner process exactly there and prove that the next attempt
// recovers (pkg/provisioner/provisionertest).
//
// A binary built without the crashpoints build tag, as every released one
// is, compiles these calls to nothing. Built with it (go build -tags
// crashpoints) and started with EGRESS_CRASHPOINT=<step>, the process
// announces on stderr, as a JSON log line {"msg":"crash point reached",
// "step":<step>}, when the operation reaches that step, and never goes
// further with it: the test then kills the process, as a crash would.
package crashpoint

// Env is the environment variable naming the step to stop at.
const Env = "EGRESS_CRASHPOINT"

// Msg is the message of the line announcing the step.
const Msg = "crash point reached"
