package request

import (
	"fmt"
	"net/http"
	"strings"
)

// A KeyFunc names the bucket a request draws from (see quota.KeyFunc).
type KeyFunc = func(*http.Request) (string, error)

// Fixed returns a KeyFunc that names the bucket name for every request. It
// panics if name is empty.
func Fixed(name string) KeyFunc {
	if name == "" {
		panic("quota: Fixed with an empty name")
	}
	return func(*http.Request) (string, error) { return name, nil }
}

// Join returns a KeyFunc that joins the names fs return with "/". It fails
// if any of fs fails or returns an empty name. It panics if fs is empty or
// holds a nil KeyFunc.
func Join[F ~func(*http.Request) (string, error)](fs ...F) F {
	if len(fs) == 0 {
		panic("quota: Join of no KeyFuncs")
	}
	for i, f := range fs {
		if f == nil {
			panic(fmt.Sprintf("quota: Join: KeyFunc %d of %d is nil", i+1, len(fs)))
		}
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

// Header returns a KeyFunc that reads the request's header name. It fails
// when the header is absent or empty. It panics if name is empty.
func Header(name string) KeyFunc {
	if name == "" {
		panic("quota: Header with an empty name")
	}
	return func(req *http.Request) (string, error) {
		v := req.Header.Get(name)
		if v == "" {
			return "", fmt.Errorf("request has no %s header", name)
		}
		return v, nil
	}
}

// AllowNames returns a KeyFunc that names buckets as f does, but only the
// names listed: any other request fails. It panics if f is nil, or names
// holds no name or the empty name, which no bucket has.
func AllowNames[F ~func(*http.Request) (string, error)](f F, names ...string) F {
	if f == nil {
		panic("quota: AllowNames with a nil KeyFunc")
	}
	if len(names) == 0 {
		panic("quota: AllowNames of no names, which would refuse every request")
	}
	allowed := make(map[string]bool, len(names))
	for _, n := range names {
		if n == "" {
			panic("quota: AllowNames with the empty name, which no bucket has")
		}
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
