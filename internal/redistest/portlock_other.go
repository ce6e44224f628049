//go:build !unix

package redistest

import "os"

// lockFile does nothing outside Unix: there, ports are only coordinated
// among the servers of one test binary.
func lockFile(*os.File) error { return nil }
