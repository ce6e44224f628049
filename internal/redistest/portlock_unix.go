//go:build unix

package redistest

import (
	"os"
	"syscall"
)

// lockFile takes an exclusive lock on f without waiting. The lock belongs
// to the open file and ends when f is closed or the process exits.
func lockFile(f *os.File) error {
	return syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
}
