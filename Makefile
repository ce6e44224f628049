# make test   installs redis-server when missing, then lints and runs every test
# make bench  the benchmarks on a real redis-server
# make lint   gofmt, go vet and staticcheck

GO          ?= go
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

.PHONY: test bench lint redis

test: redis lint
	QUOTA_REQUIRE_REDIS=1 $(GO) test -race -count=1 -timeout 15m ./...
	QUOTA_REQUIRE_REDIS=1 $(GO) test -run '^$$' -fuzz '^FuzzKeys$$' -fuzztime 10s .
	QUOTA_REQUIRE_REDIS=1 $(GO) test -run '^$$' -fuzz '^FuzzScript$$' -fuzztime 10s .

bench: redis
	QUOTA_REQUIRE_REDIS=1 $(GO) test -run '^$$' -bench . -benchmem -count 6 .

lint:
	@unformatted=$$(gofmt -l .); if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	@# What a user's build compiles: no SDK, no test or example module.
	@if $(GO) list -deps . | grep -E '^(go.opentelemetry.io/otel/sdk|github.com/alicebob/miniredis|github.com/hashicorp/go-retryablehttp|github.com/yuin/gopher-lua)'; then \
		echo "the library imports a test-only module"; exit 1; fi

redis:
	@scripts/need-redis.sh
