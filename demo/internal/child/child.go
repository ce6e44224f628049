// Package child holds what every child process of the demo shares: it must
// not outlive the demo.
package child
