package main

import "syscall"

// sysProcAttr asks the kernel to SIGKILL redis-server if the benchmark dies
// without stopping it (a panic, a kill), so no server outlives the run.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
