//go:build !unix

package redistest

import (
	"errors"
	"os"
)

var errNoStop = errors.New("pausing a process is not supported on this platform")

// stopProcess reports that SIGSTOP is unavailable.
func stopProcess(*os.Process) error { return errNoStop }

// continueProcess reports that SIGCONT is unavailable.
func continueProcess(*os.Process) error { return errNoStop }
