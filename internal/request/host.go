package request

import (
	"errors"
	"net"
	"net/http"
	"strings"
)

// Host returns the name of req's host as quota.Host names its bucket:
// lower-cased, without a trailing dot and without the scheme's default
// port, an IPv6 address in its brackets.
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
		return "", errors.New("request has no host")
	}
	return host, nil
}

// defaultPort returns the port req's scheme goes to unless told: 80 for
// http, 443 otherwise.
func defaultPort(req *http.Request) string {
	if req.URL != nil && req.URL.Scheme == "http" {
		return "80"
	}
	return "443"
}
