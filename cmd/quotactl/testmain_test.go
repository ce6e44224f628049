package main

import (
	"os"
	"testing"

	"github.com/sharedquota/quota/internal/redistest"
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m)) }
