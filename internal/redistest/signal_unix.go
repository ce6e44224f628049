//go:build unix

package redistest

import (
	"os"
	"syscall"
)

// stopProcess suspends p with SIGSTOP.
func stopProcess(p *os.Process) error { return p.Signal(syscall.SIGSTOP) }

// continueProcess resumes p with SIGCONT.
func continueProcess(p *os.Process) error { return p.Signal(syscall.SIGCONT) }
