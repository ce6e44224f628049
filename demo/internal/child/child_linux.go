package child

import "syscall"

// Attr asks the kernel to SIGKILL the child if the demo dies without
// stopping it (a crash or a SIGKILL of its own), so that no redis-server or
// worker is left behind.
func Attr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
