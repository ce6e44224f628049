package redistest

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
)

// A Proc is a program a test runs as a child process, redis-server here
// and nginx in internal/nginxtest: its output is appended to a log file,
// and on Linux the kernel kills it if the test binary dies first.
type Proc struct {
	Cmd    *exec.Cmd
	exited chan struct{} // closed once Cmd.Wait has returned
	err    error         // Cmd.Wait's, valid once exited is closed
	log    string
	start  int64 // the log's size before the launch
}

// Launch starts bin with args in dir, appending to the log file at log a
// line that names the launch, after who (the package that launches it),
// and then the program's output.
func Launch(who, bin string, args []string, dir, log string) (*Proc, error) {
	logf, err := os.OpenFile(log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	start, _ := logf.Seek(0, io.SeekEnd)
	fmt.Fprintf(logf, "=== %s: %s %s\n", who, bin, strings.Join(quoteArgs(args), " "))
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = sysProcAttr()
	err = cmd.Start()
	logf.Close()
	if err != nil {
		return nil, err
	}
	p := &Proc{Cmd: cmd, exited: make(chan struct{}), log: log, start: start}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// Running reports whether the process has not exited yet.
func (p *Proc) Running() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// Exited returns a channel closed once the process has exited.
func (p *Proc) Exited() <-chan struct{} { return p.exited }

// Err returns how the process exited, once it has.
func (p *Proc) Err() error {
	<-p.exited
	return p.err
}

// Output returns what the log holds since the launch.
func (p *Proc) Output() []byte { return readFrom(p.log, p.start) }

// LogTail returns the last n lines of the log file at path.
func LogTail(path string, n int) string { return Tail(readFrom(path, 0), n) }

// readFrom returns the content of the file at path from offset on.
func readFrom(path string, offset int64) []byte {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return nil
	}
	b, _ := io.ReadAll(f)
	return b
}

// Tail returns the last n lines of b.
func Tail(b []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
