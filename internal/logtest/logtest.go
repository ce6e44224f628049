// Package logtest records what the library logs, for its tests.
package logtest

import (
	"context"
	"log/slog"
	"strings"
	"sync"
)

// logRecorder is a slog.Handler that keeps every record.
// A Recorder is a slog.Handler that keeps every record.
type Recorder struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (h *Recorder) Enabled(context.Context, slog.Level) bool { return true }
func (h *Recorder) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *Recorder) WithGroup(string) slog.Handler            { return h }

func (h *Recorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.recs = append(h.recs, r.Clone())
	h.mu.Unlock()
	return nil
}

// Count returns how many records at level have a message containing msg.
func (h *Recorder) Count(level slog.Level, msg string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, r := range h.recs {
		if r.Level == level && strings.Contains(r.Message, msg) {
			n++
		}
	}
	return n
}

// First returns the first record whose message contains msg.
func (h *Recorder) First(msg string) (slog.Record, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.recs {
		if strings.Contains(r.Message, msg) {
			return r, true
		}
	}
	return slog.Record{}, false
}

// All returns the records whose message contains msg.
func (h *Recorder) All(msg string) []slog.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []slog.Record
	for _, r := range h.recs {
		if strings.Contains(r.Message, msg) {
			out = append(out, r)
		}
	}
	return out
}

// Last returns the last record whose message contains msg.
func (h *Recorder) Last(msg string) (slog.Record, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i := len(h.recs) - 1; i >= 0; i-- {
		if strings.Contains(h.recs[i].Message, msg) {
			return h.recs[i], true
		}
	}
	return slog.Record{}, false
}

func (h *Recorder) String() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var b strings.Builder
	for _, r := range h.recs {
		b.WriteString(r.Level.String() + " " + r.Message)
		r.Attrs(func(a slog.Attr) bool { b.WriteString(" " + a.String()); return true })
		b.WriteString("\n")
	}
	return b.String()
}

// AttrInt returns the int attribute key of r, or -1.
func AttrInt(r slog.Record, key string) int64 {
	v := int64(-1)
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v = a.Value.Int64()
		}
		return true
	})
	return v
}

// Len returns how many records h keeps.
func (h *Recorder) Len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.recs)
}
