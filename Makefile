# make demo   the fleet demonstration: the problem and the cure (see demo/),
#             then the same for an LLM API metered on tokens (demo/llm), and
#             a user's requests jumping a backfill's queue (demo/priority)
# make test   installs redis-server, tmux and nginx when missing, lints,
#             runs every test, the demo's and the Jaeger end-to-end check
#             included
# make bench  the benchmarks: quota beside a bare EVALSHA, and beside its peers;
#             the slots' figures (scripts/slot-figures.sh); then what one call
#             of the script costs Redis, beside redis_rate's
# make fuzz   the two fuzz targets, 200,000 executions each (make test runs
#             their seed corpora, as go test does)
# make e2e    the example in examples/jaeger against a real Jaeger, built once
#             per machine into a cache outside the clone
# make lint   gofmt, go vet and staticcheck on every module
# make check  the development loop, under 90 s: the library's lint, then
#             the fast tests (go test -short: miniredis and single real
#             servers; the long, multi-process, Cluster and fault tests
#             are left to make test)
# make soak   the model-based test on SEEDS random sequences of pauses, 429s,
#             limit changes, stopping workers and Redis restarts, with
#             slots, tenants and priorities (SEEDS=50 by default;
#             QUOTA_SOAK_FIRST=n starts at seed n)

GO          ?= go
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

# -trimpath keeps the clone's directory out of what is built, and so out of
# the build cache's keys: a fresh clone of a commit built before on the
# machine compiles, vets and links nothing again (about a minute of
# make test).
export GOFLAGS := $(strip $(GOFLAGS) -trimpath)

.PHONY: demo test test-packages test-demo check bench e2e lint redis fuzz soak

demo: redis
	cd demo && $(GO) run . -out ../demo-out
	cd demo && $(GO) run ./llm -out ../demo-out
	cd demo && $(GO) run ./priority -out ../demo-out

# The root package's tests run first and alone: they start real
# redis-server processes and assert rates and windows, and on two cores a
# Cluster failing over elsewhere would starve their swarms. Inside it, the
# tests that wait on real time and assert bounds with margin call
# t.Parallel and run four at a time; those that measure a latency, an
# order or the heap run alone, before them. The rest then run in two
# lanes side by side (-j2), each lane's output printed whole when it
# ends: the module's other packages, two at a time; and the benchmarks'
# short run, the demo's tests, examples/llm's and the Jaeger check. Every
# test passes with a core kept busy beside it, which each lane is to the
# other. (Test binaries are linked where they run: building them all
# first cost 24 s of linking with the packages cached.)
test: redis lint
	QUOTA_REQUIRE_REDIS=1 $(GO) test -race -count=1 -p 1 -parallel 4 -timeout 15m .
	$(MAKE) --no-print-directory -j2 --output-sync=target test-packages test-demo

test-packages:
	QUOTA_REQUIRE_REDIS=1 $(GO) test -race -count=1 -p 2 -timeout 15m ./cmd/... ./internal/... ./llm/... ./status/...

test-demo:
	cd bench && QUOTA_REQUIRE_REDIS=1 $(GO) test -count=1 ./...
	cd demo && QUOTA_REQUIRE_REDIS=1 $(GO) test -race -count=1 ./...
	cd examples/llm && QUOTA_REQUIRE_REDIS=1 $(GO) test -race -count=1 ./...
	$(MAKE) --no-print-directory e2e

check: redis
	@unformatted=$$(gofmt -l .); if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	QUOTA_REQUIRE_REDIS=1 $(GO) test -short -race -count=1 ./...

# Fuzzing runs for a count of executions, not a time: with a time, Go
# before 1.27 can report the end of fuzzing as "context deadline exceeded"
# when a worker is mid-call (golang/go#75804).
fuzz: redis
	QUOTA_REQUIRE_REDIS=1 $(GO) test -run '^$$' -fuzz '^FuzzKeys$$' -fuzztime 200000x .
	QUOTA_REQUIRE_REDIS=1 $(GO) test -run '^$$' -fuzz '^FuzzScript$$' -fuzztime 200000x .

# Each seed's failure names it: QUOTA_SOAK_FIRST=<seed> make soak SEEDS=1
# runs it again.
SEEDS ?= 50
soak: redis
	QUOTA_REQUIRE_REDIS=1 QUOTA_SOAK_SEEDS=$(SEEDS) $(GO) test -race -count=1 -run '^TestModelSequences$$' -timeout 60m .

bench: redis
	QUOTA_REQUIRE_REDIS=1 $(GO) test -run '^$$' -bench . -benchmem -count 8 .
	GO=$(GO) scripts/slot-figures.sh
	cd bench && $(GO) run .
	scripts/script-cost.sh
	QUOTA_ADAPT_FULL=1 QUOTA_REQUIRE_REDIS=1 $(GO) test -count=1 -v -timeout 20m -run 'TestFleetLearns|TestQuietBesideBusy' ./internal/adapt/

e2e: redis
	GO=$(GO) STATICCHECK=$(STATICCHECK) scripts/e2e.sh

lint:
	@unformatted=$$(gofmt -l .); if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted"; exit 1; fi
	$(GO) vet ./...
	cd demo && $(GO) vet ./...
	cd bench && $(GO) vet ./...
	cd examples/llm && $(GO) vet ./...
	GO=$(GO) STATICCHECK=$(STATICCHECK) scripts/staticcheck.sh . demo bench examples/llm
	@# What a user's build compiles, the library's, its llm package's and
	@# the quotactl command's: no SDK, no test or example module.
	@if $(GO) list -deps . ./llm ./cmd/quotactl | grep -E '^(go.opentelemetry.io/otel/sdk|github.com/alicebob/miniredis|github.com/hashicorp/go-retryablehttp|github.com/yuin/gopher-lua|github.com/openai/|github.com/anthropics/)'; then \
		echo "the library imports a test-only module"; exit 1; fi
	@# The terminal UI's modules (bubbletea, lipgloss and theirs), which
	@# go.mod requires for quotactl top, are the command's alone: the
	@# library and its packages llm and status compile none of them.
	@if $(GO) list -deps . ./llm ./status | grep -E '^github.com/(charmbracelet|muesli|lucasb-eyer|erikgeiser|aymanbagabas|xo)/'; then \
		echo "the library imports a terminal UI module, which only cmd/quotactl may"; exit 1; fi

# The programs the tests start (redis-server and redis-sentinel, tmux,
# nginx), installed with apt-get when missing.
redis:
	@scripts/need.sh redis tmux nginx
