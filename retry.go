package quota

import (
	"context"
	"net/http"
)

// Permanent reports whether err, returned by a Transport or a Limiter, is a
// refusal that trying again will not change: invalid input, a script
// error, a Redis user without permission, or a wait that would pass the
// request's deadline. Waiting for a token is already the Transport's job,
// so a retry loop should stop on these. ErrWouldWait is not permanent:
// the caller chose not to wait (WithNoWait), and the tokens a retry needs
// accrue during its backoff. Nor is ErrUnavailable, a refusal while Redis
// is unavailable under FailClosed: an outage of a second is what a retry's
// backoff rides out.
func Permanent(err error) bool {
	return sentinels.Permanent(err)
}

// CheckRetry wraps a retry policy of github.com/hashicorp/go-retryablehttp
// so that it does not retry the package's permanent refusals (see
// Permanent), which retryablehttp would otherwise retry as unknown errors.
// Everything else is left to next:
//
//	client := retryablehttp.NewClient()
//	client.HTTPClient.Transport = quota.NewTransport(rdb, lim)
//	client.CheckRetry = quota.CheckRetry(retryablehttp.DefaultRetryPolicy)
//
// The result is a plain func, assignable to retryablehttp.CheckRetry
// without this package importing retryablehttp. It panics if next is nil.
func CheckRetry(next func(context.Context, *http.Response, error) (bool, error)) func(context.Context, *http.Response, error) (bool, error) {
	if next == nil {
		panic("quota: CheckRetry(nil)")
	}
	return func(ctx context.Context, resp *http.Response, err error) (bool, error) {
		if err != nil && Permanent(err) {
			return false, err
		}
		return next(ctx, resp, err)
	}
}
