package lifecycle

// Step is what an in-flight command does for the reconciler; several steps
// map to the same provisioner operation. Its number is stored
// (proxies.command_step): append new steps, never renumber.
type Step int16

// The steps.
const (
	// StepNone: no command in flight, or none to resume.
	StepNone Step = iota
	// StepCreate creates the instance.
	StepCreate
	// StepPoll reads a live instance (waiting for its address, or resync).
	StepPoll
	// StepReplaceDelete deletes an instance whose spec changed (or that
	// stayed stopped too long).
	StepReplaceDelete
	// StepReplacePoll waits for a replaced instance to be gone.
	StepReplacePoll
	// StepCleanupGet reads the instance of a deleting proxy.
	StepCleanupGet
	// StepCleanupDelete deletes the instance of a deleting proxy, then polls.
	StepCleanupDelete
	// StepCleanupDeleteRelease deletes the instance of a deleting proxy whose
	// Get failed permanently, releasing the proxy when Delete succeeds.
	StepCleanupDeleteRelease
	// StepUpdateCredentials makes a live instance demand the proxy's new
	// credentials in place; where its provider cannot, the proxy goes on
	// with StepReplaceDelete.
	StepUpdateCredentials
)

func (s Step) String() string {
	switch s {
	case StepCreate:
		return "create"
	case StepPoll:
		return "poll"
	case StepReplaceDelete:
		return "replace-delete"
	case StepReplacePoll:
		return "replace-poll"
	case StepCleanupGet:
		return "cleanup-get"
	case StepCleanupDelete:
		return "cleanup-delete"
	case StepCleanupDeleteRelease:
		return "cleanup-delete-release"
	case StepUpdateCredentials:
		return "update-credentials"
	}
	return "none"
}
