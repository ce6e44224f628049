// Package workers runs a demo's worker processes: copies of the demo's own
// binary, each given its spec as JSON in an environment variable, each
// writing its report as JSON to its stdout when it ends.
package workers

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"

	"github.com/sharedquota/quota/demo/internal/child"
)

// Run starts one worker per spec, the binary run with the argument arg
// and the spec in the environment variable env, relays each worker's
// stderr to logs, a line at a time after "  worker <n> | " (n counting
// from 1 in the order of specs), and returns their reports in that
// order once they have all ended.
func Run[S, R any](ctx context.Context, env, arg string, specs []S, logs io.Writer) ([]R, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	var cmds []*exec.Cmd
	var outs []*bytes.Buffer
	var relays sync.WaitGroup
	var logMu sync.Mutex // the relays write logs one line at a time
	kill := func() {
		for _, cmd := range cmds {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		relays.Wait()
	}
	for i, spec := range specs {
		js, err := json.Marshal(spec)
		if err != nil {
			kill()
			return nil, err
		}
		cmd := exec.CommandContext(ctx, self, arg)
		cmd.Env = append(os.Environ(), env+"="+string(js))
		cmd.SysProcAttr = child.Attr()
		out := new(bytes.Buffer)
		cmd.Stdout = out
		stderr, err := cmd.StderrPipe()
		if err != nil {
			kill()
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			kill()
			return nil, fmt.Errorf("starting worker %d: %w", i+1, err)
		}
		cmds, outs = append(cmds, cmd), append(outs, out)
		relays.Go(func() {
			sc := bufio.NewScanner(stderr)
			for sc.Scan() {
				logMu.Lock()
				fmt.Fprintf(logs, "  worker %d | %s\n", i+1, sc.Text())
				logMu.Unlock()
			}
		})
	}
	relays.Wait()
	reports := make([]R, len(cmds))
	for i, cmd := range cmds {
		err := cmd.Wait()
		if err == nil {
			err = json.Unmarshal(outs[i].Bytes(), &reports[i])
		}
		if err != nil {
			return nil, fmt.Errorf("worker %d: %w", i+1, err)
		}
	}
	return reports, nil
}
