package main

import (
	"context"
	"errors"
	"io"
	"os"
	"slices"
	"sync"
	"time"

	tea "github.com/charmbracelet/bubbletea"
	"github.com/charmbracelet/lipgloss"
	"github.com/charmbracelet/x/term"
	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/status"
)

// top's pace: it reads every bucket it knows of each refresh, and looks
// for buckets (SCAN, as list does) each rescan, while the list shows.
const (
	refresh     = time.Second
	rescan      = 5 * time.Second
	readTimeout = 2 * time.Second // a refresh's reads, and a scan
	readers     = 8               // the buckets read at once
)

// topSource is where top reads: the names of the buckets under the
// prefix, and one bucket whole.
type topSource struct {
	names func(ctx context.Context) ([]string, error)
	read  func(ctx context.Context, name string) (status.Bucket, error)
}

// redisSource reads the buckets under prefix in rdb: their names as list
// finds them, with SCAN on every master of a Cluster, and each bucket with
// status.Read's pipelined reads. A name that list prints shortened is
// left out: a bucket is read by its whole name.
func redisSource(rdb redis.UniversalClient, prefix string) topSource {
	return topSource{
		names: func(ctx context.Context) ([]string, error) {
			found, err := list(ctx, rdb, prefix)
			if err != nil {
				return nil, err
			}
			names := make([]string, 0, len(found))
			for _, b := range found {
				if !b.Shortened {
					names = append(names, b.Name)
				}
			}
			return names, nil
		},
		read: func(ctx context.Context, name string) (status.Bucket, error) {
			return status.Read(ctx, rdb, prefix, name)
		},
	}
}

// isTerminal reports whether f is a terminal.
func isTerminal(f any) bool {
	file, ok := f.(*os.File)
	return ok && term.IsTerminal(file.Fd())
}

// runTop shows the live view of the buckets under cmd.prefix in rdb, at
// addr, on the terminal stdin and stdout, until q, Ctrl-C or a SIGINT or
// SIGTERM: each ends it cleanly, the terminal restored.
func runTop(ctx context.Context, rdb redis.UniversalClient, cmd command, addr string, stdin io.Reader, stdout io.Writer) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	m := newTopModel(ctx, redisSource(rdb, cmd.prefix), newTopStyles(lipgloss.NewRenderer(stdout)))
	m.title = "quotactl top   redis " + addr + "   prefix " + quoteName(cmd.prefix)
	if cmd.name != "" {
		m.detail, m.selected, m.fixed = cmd.name, cmd.name, true
	}
	p := tea.NewProgram(m, tea.WithContext(ctx), tea.WithInput(stdin), tea.WithOutput(stdout), tea.WithAltScreen())
	_, err := p.Run()
	if errors.Is(err, tea.ErrInterrupted) {
		return nil // a SIGINT, as Ctrl-C
	}
	return err
}

// fetchedMsg is what a refresh read.
type fetchedMsg struct {
	scanned bool     // names holds a scan's result
	names   []string // the buckets found, when scanned
	scanErr error
	buckets map[string]status.Bucket // by name, those read
	readErr error                    // the first read that failed
}

// fetch reads the buckets called names, and first scans for the buckets
// when scan, with src. It runs outside the program's loop (a tea.Cmd),
// and reads only what it is given.
func fetch(ctx context.Context, src topSource, scan bool, names []string, also string) fetchedMsg {
	ctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	msg := fetchedMsg{scanned: scan, buckets: map[string]status.Bucket{}}
	if scan {
		found, err := src.names(ctx)
		if err != nil {
			msg.scanned, msg.scanErr = false, err
		} else {
			names = found
			msg.names = found
		}
	}
	if also != "" && !slices.Contains(names, also) {
		names = append(names[:len(names):len(names)], also)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, readers)
	for _, name := range names {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			b, err := src.read(ctx, name)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				msg.buckets[name] = b
			case msg.readErr == nil:
				msg.readErr = err
			}
		})
	}
	wg.Wait()
	return msg
}
