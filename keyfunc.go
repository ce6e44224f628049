package quota

import (
	"net/http"

	"github.com/sharedquota/quota/internal/request"
)

// A KeyFunc names the bucket a request draws from. Requests with the same
// name share one bucket; the Limiter turns the name into a Redis key (see
// WithPrefix). Return an error to refuse the request: it fails with an error
// matching ErrInvalidKey and the error returned.
type KeyFunc func(*http.Request) (string, error)

// Host names the bucket after the request's host, lower-cased, without a
// trailing dot and without the scheme's default port: "api.example.com",
// "api.example.com:8443". It is the Transport's default KeyFunc.
func Host(req *http.Request) (string, error) { return request.Host(req) }

// Fixed returns a KeyFunc that names the same bucket for every request, for
// a provider that meters one account whatever host it is reached by, or a
// region set in configuration: Join(Host, Fixed("eu")). It panics if name is
// empty.
func Fixed(name string) KeyFunc { return request.Fixed(name) }

// Join returns a KeyFunc that joins the names fs return with "/", for a
// provider that meters each combination separately: Join(Host,
// Header("X-Region")) names "api.example.com/eu" for a request to
// api.example.com that carries X-Region: eu. It fails if any of fs fails or returns an
// empty name. It panics if fs is empty or holds a nil KeyFunc.
func Join(fs ...KeyFunc) KeyFunc { return request.Join(fs...) }

// Header returns a KeyFunc that reads the request's header name, for
// example the region a request is meant for. It fails when the header is
// absent or empty. It panics if name is empty.
func Header(name string) KeyFunc { return request.Header(name) }

// AllowNames returns a KeyFunc that names buckets as f does, but only the names
// listed: any other request fails with an error matching ErrInvalidKey and
// is not sent. Use it where requests may go to arbitrary URLs, so that
// they cannot create buckets of their own. It panics if f is nil, or names
// holds no name or the empty name, which no bucket has: it would refuse
// every request.
func AllowNames(f KeyFunc, names ...string) KeyFunc { return request.AllowNames(f, names...) }
