//go:build !linux

package child

import "syscall"

// Attr returns nil: outside Linux a child is stopped only by the demo
// itself.
func Attr() *syscall.SysProcAttr { return nil }
