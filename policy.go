package quota

// A Mode is how a Limiter is granting tokens at the moment.
type Mode int

const (
	// ModeShared grants from the shared bucket in Redis: the normal mode.
	ModeShared Mode = iota
	// ModeClosed refuses every request while Redis is unavailable.
	ModeClosed
)

// String returns the mode's name as it appears in logs and telemetry.
func (m Mode) String() string {
	switch m {
	case ModeShared:
		return "shared"
	case ModeClosed:
		return "closed"
	}
	return "unknown"
}

// A Policy decides what a Limiter does with requests while Redis is
// unavailable. The zero Policy is FailClosed.
type Policy struct {
	degraded Mode // the mode while Redis is unavailable
}

// FailClosed refuses requests with an error wrapping ErrUnavailable while
// Redis is unavailable. It is the default: without Redis the limiter cannot
// know what the rest of the fleet is sending, and refusing is the only
// choice that cannot breach the provider's limit.
var FailClosed = Policy{degraded: ModeClosed}

// String names the policy as it appears in logs.
func (p Policy) String() string {
	switch p.mode() {
	case ModeClosed:
		return "fail closed"
	}
	return "unknown"
}

func (p Policy) mode() Mode {
	if p.degraded == ModeShared {
		return ModeClosed
	}
	return p.degraded
}
