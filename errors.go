package quota

import (
	"context"
	"errors"
)

// Errors returned by the Limiter and the Transport. Each one is matched with
// errors.Is; the returned errors wrap them with the detail of the case.
var (
	// ErrInvalidLimit reports a Limit with a rate that is not a finite number
	// above zero, or a burst that is negative or not finite.
	ErrInvalidLimit = errors.New("quota: invalid limit")

	// ErrInvalidTokens reports a request for zero, a negative number, or a
	// non-finite number of tokens.
	ErrInvalidTokens = errors.New("quota: invalid number of tokens")

	// ErrExceedsBurst reports a request for more tokens than the bucket
	// holds: it could never be granted.
	ErrExceedsBurst = errors.New("quota: more tokens than the burst")

	// ErrInvalidKey reports an empty bucket name or a KeyFunc that failed.
	ErrInvalidKey = errors.New("quota: invalid key")

	// ErrUnavailable reports that Redis could not be reached or could not
	// serve the request, and the Policy refused the request.
	ErrUnavailable = errors.New("quota: redis unavailable")

	// ErrNoPermission reports that the Redis user may not run the script or
	// touch its keys (an ACL NOPERM reply). It is a misconfiguration, not an
	// outage: the policy does not hide it.
	ErrNoPermission = errors.New("quota: redis user lacks permission")

	// ErrScript reports a script that failed on the server or a reply this
	// package cannot decode. It is a bug or a misconfiguration (for example a
	// key of another type under the prefix), not an outage.
	ErrScript = errors.New("quota: script failed")

	// ErrWouldExceedDeadline reports that the wait for the tokens would end
	// after the context's deadline, so nothing was taken. errors.Is also
	// matches it against context.DeadlineExceeded.
	ErrWouldExceedDeadline error = deadlineError{}
)

type deadlineError struct{}

func (deadlineError) Error() string { return "quota: wait would exceed the context deadline" }

func (deadlineError) Is(target error) bool { return target == context.DeadlineExceeded }
