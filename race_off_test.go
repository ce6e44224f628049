//go:build !race

package quota

// raceDetector tells the tests whether the race detector is on: it slows
// goroutines several times, and bounds on what timing decides widen.
const raceDetector = false
