package quota

import (
	"fmt"
	"net"
	"net/http"
	"strings"
)

// A KeyFunc names the bucket a request draws from. Requests with the same
// name share one bucket; the Limiter turns the name into a Redis key (see
// WithPrefix). Return an error to refuse the request: it fails with an error
// matching ErrInvalidKey and the error returned.
type KeyFunc func(*http.Request) (string, error)

// Host names the bucket after the request's host, lower-cased, without a
// trailing dot and without the scheme's default port: "api.example.com",
// "api.example.com:8443". It is the Transport's default KeyFunc.
func Host(req *http.Request) (string, error) {
	host := req.Host
	if host == "" && req.URL != nil {
		host = req.URL.Host
	}
	host = strings.ToLower(host)
	if h, port, err := net.SplitHostPort(host); err == nil && port == defaultPort(req) {
		host = h
		if strings.Contains(h, ":") {
			host = "[" + h + "]" // IPv6 keeps its brackets
		}
	}
	host = strings.TrimSuffix(host, ".")
	if host == "" {
		return "", fmt.Errorf("request has no host")
	}
	return host, nil
}

func defaultPort(req *http.Request) string {
	if req.URL != nil && req.URL.Scheme == "http" {
		return "80"
	}
	return "443"
}

// Fixed returns a KeyFunc that names the same bucket for every request, for
// a provider that meters one account whatever host it is reached by, or a
// region set in configuration: Join(Host, Fixed("eu")). It panics if name is
// empty.
func Fixed(name string) KeyFunc {
	if name == "" {
		panic("quota: Fixed with an empty name")
	}
	return func(*http.Request) (string, error) { return name, nil }
}

// Join returns a KeyFunc that joins the names fs return with "/", for a
// provider that meters each combination separately: Join(Host,
// Header("X-Region")) names "api.example.com/eu" for a request to
// api.example.com that carries X-Region: eu. It fails if any of fs fails or returns an
// empty name.
func Join(fs ...KeyFunc) KeyFunc {
	if len(fs) == 0 {
		panic("quota: Join of no KeyFuncs")
	}
	return func(req *http.Request) (string, error) {
		parts := make([]string, len(fs))
		for i, f := range fs {
			p, err := f(req)
			if err != nil {
				return "", err
			}
			if p == "" {
				return "", fmt.Errorf("part %d of the key is empty", i+1)
			}
			parts[i] = p
		}
		return strings.Join(parts, "/"), nil
	}
}

// Header returns a KeyFunc that reads the request's header name, for
// example the region a request is meant for. It fails when the header is
// absent or empty.
func Header(name string) KeyFunc {
	return func(req *http.Request) (string, error) {
		v := req.Header.Get(name)
		if v == "" {
			return "", fmt.Errorf("request has no %s header", name)
		}
		return v, nil
	}
}

// AllowNames returns a KeyFunc that names buckets as f does, but only the names
// listed: any other request fails with an error matching ErrInvalidKey and
// is not sent. Use it where requests may go to arbitrary URLs, so that
// they cannot create buckets of their own.
func AllowNames(f KeyFunc, names ...string) KeyFunc {
	allowed := make(map[string]bool, len(names))
	for _, n := range names {
		allowed[n] = true
	}
	return func(req *http.Request) (string, error) {
		name, err := f(req)
		if err != nil {
			return "", err
		}
		if !allowed[name] {
			return "", fmt.Errorf("%q is not an allowed bucket", name)
		}
		return name, nil
	}
}
