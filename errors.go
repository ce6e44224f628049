package quota

import (
	"context"
	"errors"
	"fmt"

	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/redisx"
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

	// ErrInvalidPriority reports a priority outside 0 to MaxPriority.
	ErrInvalidPriority = errors.New("quota: invalid priority")

	// ErrUnavailable reports that Redis could not be reached or could not
	// serve the request, and the Policy refused the request.
	ErrUnavailable = errors.New("quota: redis unavailable")

	// ErrNoPermission reports that the Redis user may not run the script, a
	// command the script calls, or touch its keys or channel (an ACL NOPERM
	// reply, or the refusal of a command inside a script), or could not log
	// in (WRONGPASS, NOAUTH). It is a misconfiguration, not an outage: the
	// policy does not hide it, and the Limiter logs the first one.
	ErrNoPermission = errors.New("quota: redis user lacks permission")

	// ErrScript reports a call the server rejected as wrong, or a reply this
	// package cannot decode. It is a bug or a misconfiguration, not an
	// outage: for example a key of another type under the prefix, or a
	// plain *redis.Client pointed at one node of a Redis Cluster, which
	// answers MOVED for the buckets other nodes serve.
	ErrScript = errors.New("quota: script failed")

	// ErrWouldWait reports that the tokens are not available now and the
	// caller asked not to wait for them (a Transport WithNoWait), so nothing
	// was taken. The returned error names the bucket and how long the wait
	// would have been. It is not Permanent: tokens accrue, so a retry after
	// a backoff may find them.
	ErrWouldWait = errors.New("quota: tokens not available now")

	// ErrWouldExceedDeadline reports that the wait for the tokens would end
	// after the context's deadline, so nothing was taken. errors.Is also
	// matches it against context.DeadlineExceeded.
	ErrWouldExceedDeadline error = deadlineError{}
)

type deadlineError struct{}

func (deadlineError) Error() string { return "quota: wait would exceed the context deadline" }

func (deadlineError) Is(target error) bool { return target == context.DeadlineExceeded }

// sentinels is the one table of what each error means: its error.type, the
// outcome it gives an acquisition, and whether it is permanent (see
// Permanent). Earlier rows win, so ErrWouldExceedDeadline comes before the
// context.DeadlineExceeded it also matches.
var sentinels = obs.Sentinels{
	{Err: ErrWouldExceedDeadline, Type: "would_exceed_deadline", Outcome: obs.Refused, Permanent: true},
	{Err: ErrWouldWait, Type: "would_wait", Outcome: obs.Refused},
	{Err: ErrUnavailable, Type: "unavailable", Outcome: obs.Refused},
	{Err: ErrScript, Type: "script", Outcome: obs.Failed, Permanent: true},
	{Err: ErrNoPermission, Type: "no_permission", Outcome: obs.Failed, Permanent: true},
	{Err: ErrInvalidLimit, Type: "invalid_limit", Outcome: obs.Failed, Permanent: true},
	{Err: ErrInvalidTokens, Type: "invalid_tokens", Outcome: obs.Failed, Permanent: true},
	{Err: ErrExceedsBurst, Type: "exceeds_burst", Outcome: obs.Failed, Permanent: true},
	{Err: ErrInvalidKey, Type: "invalid_key", Outcome: obs.Failed, Permanent: true},
	{Err: ErrInvalidPriority, Type: "invalid_priority", Outcome: obs.Failed, Permanent: true},
	{Err: context.Canceled, Type: "canceled", Outcome: obs.Cancelled},
	{Err: context.DeadlineExceeded, Type: "deadline_exceeded", Outcome: obs.Cancelled},
}

// classify turns an error of a Redis call into the error a caller gets: the
// caller's own context error, ErrNoPermission or ErrScript for a call the
// server rejects as wrong (a misconfiguration or a bug, which no policy
// should hide), or ErrUnavailable for everything that says the server cannot
// serve now. cluster tells whether the client follows a Cluster's
// redirections itself, in which case one that still fails is an outage.
func classify(ctx context.Context, err error, cluster bool) error {
	class := redisx.Classify(ctx, err, cluster)
	switch {
	case class == redisx.Ended:
		return ctx.Err()
	case class == redisx.Deadline:
		return context.DeadlineExceeded
	case errors.Is(err, ErrScript):
		return err
	}
	switch class {
	case redisx.NoPermission:
		return fmt.Errorf("%w: %w", ErrNoPermission, err)
	case redisx.NotCluster:
		return fmt.Errorf("%w: %w: the server is a node of a Redis Cluster; use a *redis.ClusterClient", ErrScript, err)
	case redisx.Rejected, redisx.BadReply:
		return fmt.Errorf("%w: %w", ErrScript, err)
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}
