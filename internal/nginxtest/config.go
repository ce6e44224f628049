package nginxtest

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
)

// rateSpec writes rate, in requests per second, as nginx's rate parameter.
func rateSpec(rate float64) (string, error) {
	whole := func(x float64) (int64, bool) {
		r := math.Round(x)
		return int64(r), r >= 1 && r < 1<<40 && math.Abs(x-r) <= 1e-9*r
	}
	if n, ok := whole(rate); ok {
		return fmt.Sprintf("%dr/s", n), nil
	}
	if n, ok := whole(rate * 60); ok {
		return fmt.Sprintf("%dr/m", n), nil
	}
	return "", fmt.Errorf("rate %v/s is not a whole number of requests per second or per minute, which is all nginx takes", rate)
}

// readyToken returns a string that identifies one launch in the answers
// of its readiness location.
func readyToken() string {
	return fmt.Sprintf("nginxtest-%016x", rand.Uint64())
}

// config returns nginx.conf. Its paths are relative to the prefix (-p),
// the server's directory.
func config(rate string, burst, port int, token string) string {
	// nginx refuses burst=0, which is the default.
	burstParam := ""
	if burst > 0 {
		burstParam = " burst=" + strconv.Itoa(burst)
	}
	return fmt.Sprintf(`# Written by internal/nginxtest.
daemon off;
master_process off;
worker_processes 1;
pid nginx.pid;
error_log error.log notice;

events {
	worker_connections 512;
}

http {
	access_log off;
	client_body_temp_path tmp/body;
	proxy_temp_path tmp/proxy;
	fastcgi_temp_path tmp/fastcgi;
	uwsgi_temp_path tmp/uwsgi;
	scgi_temp_path tmp/scgi;

	limit_req_zone $server_name zone=z:1m rate=%s;
	# Refusals are logged below error.log's level: its tail then shows
	# what went wrong, if anything did.
	limit_req_log_level info;

	server {
		listen 127.0.0.1:%d;
		server_name nginxtest;
		root html;
		default_type text/plain;

		location / {
			limit_req zone=z%s nodelay;
			try_files /ok.txt =404;
		}

		location = %s {
			return 200 "%s";
		}
	}
}
`, rate, port, burstParam, readyPath, token)
}
