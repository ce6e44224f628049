package main

import (
	"encoding/csv"
	"fmt"
	"os"
	"strconv"
)

// writeArrivals writes every request the provider received, one row each:
// the phase, the seconds since the phase started, the worker that sent it
// and the status it was answered with.
func writeArrivals(path string, results []phaseResult) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	_ = w.Write([]string{"phase", "seconds", "worker", "status"})
	for _, r := range results {
		for _, a := range r.arrivals {
			status := "200"
			if a.Refused {
				status = "429"
			}
			_ = w.Write([]string{strconv.Itoa(r.num), fmt.Sprintf("%.4f", a.At.Sub(r.start).Seconds()), strconv.Itoa(a.Worker), status})
		}
	}
	w.Flush()
	if err := w.Error(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
