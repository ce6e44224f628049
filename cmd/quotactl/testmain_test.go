package main

import (
	"os"
	"testing"

	"github.com/sharedquota/quota/internal/redistest"
)

func TestMain(m *testing.M) {
	code := redistest.Main(m)
	redistest.Skipped(int(tmuxSkipped.Load()), "tmux", tmuxHint)
	os.Exit(code)
}
