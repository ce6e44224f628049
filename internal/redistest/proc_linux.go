package redistest

import "syscall"

// sysProcAttr asks the kernel to SIGKILL the server if the test binary dies
// without running its cleanups (a panic or a test timeout), so no server
// outlives the tests. The signal is tied to the thread that started the
// child; Go only retires threads whose goroutine exits while locked to the
// thread, which the testing package does not do.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
