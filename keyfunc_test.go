package quota

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
)

// Tests of the KeyFuncs (keyfunc.go): Host, Fixed, Join, Header and
// AllowNames.

func TestHost(t *testing.T) {
	for _, tc := range []struct{ url, host, want string }{
		{"https://API.Example.com/v1", "", "api.example.com"},
		{"https://api.example.com:443/v1", "", "api.example.com"},
		{"http://api.example.com:80/v1", "", "api.example.com"},
		{"http://api.example.com:443/v1", "", "api.example.com:443"},
		{"https://api.example.com:8443/v1", "", "api.example.com:8443"},
		{"https://api.example.com./v1", "", "api.example.com"},
		{"https://[::1]:443/", "", "[::1]"},
		{"https://[::1]:8443/", "", "[::1]:8443"},
		{"https://10.0.0.1/", "Geo.Example.com", "geo.example.com"},
	} {
		req := httptest.NewRequest("GET", tc.url, nil)
		req.Host = tc.host
		if tc.host == "" {
			req.Host = ""
		}
		got, err := Host(req)
		if err != nil || got != tc.want {
			t.Errorf("Host(%s, Host=%q) = %q, %v; want %q", tc.url, tc.host, got, err, tc.want)
		}
	}
	if _, err := Host(&http.Request{URL: &url0}); err == nil {
		t.Error("Host of a request without a host: want an error")
	}
}

var url0 = *httptest.NewRequest("GET", "/relative", nil).URL

func TestKeyFuncs(t *testing.T) {
	req := httptest.NewRequest("GET", "https://geo.example.com/v1", nil)
	req.Header.Set("X-Region", "eu")
	for _, tc := range []struct {
		name string
		f    KeyFunc
		want string
	}{
		{"fixed", Fixed("geocoder"), "geocoder"},
		{"host region fixed", Join(Host, Fixed("us")), "geo.example.com/us"},
		{"host region header", Join(Host, Header("X-Region")), "geo.example.com/eu"},
		{"join", Join(Fixed("acct"), Host, Header("X-Region")), "acct/geo.example.com/eu"},
	} {
		got, err := tc.f(req)
		if err != nil || got != tc.want {
			t.Errorf("%s: got %q, %v; want %q", tc.name, got, err, tc.want)
		}
	}
	if _, err := Join(Host, Header("X-Missing"))(req); err == nil {
		t.Error("Join with a missing header: want an error")
	}
	empty := func(*http.Request) (string, error) { return "", nil }
	if _, err := Join(Host, empty)(req); err == nil {
		t.Error("Join with an empty part: want an error")
	}
	mustPanic(t, "Fixed(\"\")", func() { Fixed("") })
	mustPanic(t, "Join()", func() { Join() })
}

func TestAllow(t *testing.T) {
	_, rdb, cmds := newMini(t)
	var sent atomic.Int64
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) { sent.Add(1); return okResponse(r) })
	tr := NewTransport(rdb, PerSecond(10), WithBase(base), WithKey(AllowNames(Host, "api.example.com", "geo.example.com")))
	for _, tc := range []struct {
		url string
		ok  bool
	}{
		{"https://API.example.com/v1", true},
		{"https://geo.example.com:443/", true},
		{"https://evil.example.net/", false},
		{"https://api.example.com.evil.net/", false},
	} {
		req := httptest.NewRequest("GET", tc.url, nil)
		req.RequestURI = ""
		_, err := tr.RoundTrip(req)
		if tc.ok != (err == nil) || (!tc.ok && !errors.Is(err, ErrInvalidKey)) {
			t.Errorf("%s: err = %v", tc.url, err)
		}
	}
	if sent.Load() != 2 || cmds.total() != 2 {
		t.Errorf("%d requests sent with %d Redis commands, want 2 and 2", sent.Load(), cmds.total())
	}
}
