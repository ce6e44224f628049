package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sharedquota/quota/demo/internal/child"
)

// A fleet is the worker processes of one phase.
type fleet struct {
	procs   []*exec.Cmd
	stdouts []*bytes.Buffer
	relays  sync.WaitGroup
	logs    *logRelay
}

// startFleet starts one worker process per spec, each a copy of this
// binary, and relays their stderr to logs.
func startFleet(ctx context.Context, specs []workerSpec, logs *logRelay) (*fleet, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	f := &fleet{logs: logs}
	for _, spec := range specs {
		env, err := json.Marshal(spec)
		if err != nil {
			return nil, err
		}
		cmd := exec.CommandContext(ctx, self, workerArg)
		cmd.Env = append(os.Environ(), workerEnv+"="+string(env))
		cmd.SysProcAttr = child.Attr()
		out := new(bytes.Buffer)
		cmd.Stdout = out
		stderr, err := cmd.StderrPipe()
		if err != nil {
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			f.kill()
			return nil, fmt.Errorf("starting worker %d: %w", spec.ID, err)
		}
		f.procs = append(f.procs, cmd)
		f.stdouts = append(f.stdouts, out)
		f.relays.Go(func() { logs.relay(spec.ID, stderr) })
	}
	return f, nil
}

// wait waits for every worker to end and returns their reports.
func (f *fleet) wait() ([]workerReport, error) {
	f.relays.Wait()
	var reports []workerReport
	var firstErr error
	for i, cmd := range f.procs {
		err := cmd.Wait()
		var rep workerReport
		if err == nil {
			err = json.Unmarshal(f.stdouts[i].Bytes(), &rep)
		}
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("worker %d: %w", i+1, err)
		}
		reports = append(reports, rep)
	}
	return reports, firstErr
}

// kill ends the workers started so far.
func (f *fleet) kill() {
	for _, cmd := range f.procs {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
}

// A logRelay shows the workers' log lines to the user, each prefixed by the
// time into the phase and the worker's number, and counts the quota
// package's records of a change of mode.
type logRelay struct {
	w     io.Writer
	start time.Time // of the phase

	mu         sync.Mutex
	outages    int // "quota: Redis unavailable" records
	recoveries int // "quota: Redis available again" records
	served     int // the requests the policy served, summed over the recovery records
}

// relay copies r to the relay's writer line by line until r ends.
func (l *logRelay) relay(id int, r io.Reader) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		l.mu.Lock()
		switch {
		case strings.Contains(line, `msg="quota: Redis unavailable`):
			l.outages++
		case strings.Contains(line, `msg="quota: Redis available again`):
			l.recoveries++
			l.served += servedIn(line)
		}
		l.mu.Unlock()
		l.printf("worker %d | %s", id, line)
	}
}

// printf writes one line stamped with the time into the phase.
func (l *logRelay) printf(format string, args ...any) {
	at := time.Since(l.start).Seconds()
	fmt.Fprintf(l.w, "  %+5.1fs  %s\n", at, fmt.Sprintf(format, args...))
}

// counts returns how many outage and recovery records were relayed, and
// how many requests the recovery records say the policy served during the
// outage.
func (l *logRelay) counts() (outages, recoveries, served int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.outages, l.recoveries, l.served
}

// servedIn returns the served attribute of a recovery record, 0 if it has
// none.
func servedIn(line string) int {
	_, v, ok := strings.Cut(line, " served=")
	if !ok {
		return 0
	}
	v, _, _ = strings.Cut(v, " ")
	n, _ := strconv.Atoi(v)
	return n
}
