//go:build !linux

package redistest

import "syscall"

// sysProcAttr returns nil: outside Linux a server is only stopped by the
// test's cleanups.
func sysProcAttr() *syscall.SysProcAttr { return nil }
