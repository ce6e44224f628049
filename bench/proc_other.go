//go:build !linux

package main

import "syscall"

// sysProcAttr returns nil: outside Linux redis-server is stopped only by
// the benchmark's own exit path.
func sysProcAttr() *syscall.SysProcAttr { return nil }
