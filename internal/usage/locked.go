package usage

import "sync"

// A Locked serialises the calls of a reader of a response's usage (see
// quota.UsageReader): a body may be closed while another goroutine reads
// it.
type Locked[U any] struct {
	mu sync.Mutex
	R  interface {
		Write(p []byte) (int, error)
		Usage() (U, bool)
	}
}

// Write writes p to the reader.
func (l *Locked[U]) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.R.Write(p)
}

// Usage returns the reader's usage.
func (l *Locked[U]) Usage() (U, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.R.Usage()
}
