package local

import (
	"fmt"
	"sync"
)

// Slots are the slots of FallbackLocal: this process's share of each
// bucket's slots, a semaphore each, whose blocked callers are served in
// order.
type Slots struct {
	mu sync.Mutex
	m  map[localSlotsKey]chan struct{}
}

type localSlotsKey struct {
	key   string // the bucket's
	share int
}

// Get returns the semaphore of the bucket with key and share slots. Past
// maxLocalBuckets buckets, it drops those with no slot held, and refuses a
// new bucket with ErrFull when every one holds some.
func (ls *Slots) Get(key string, share int) (chan struct{}, error) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	k := localSlotsKey{key, share}
	if sem, ok := ls.m[k]; ok {
		return sem, nil
	}
	if ls.m == nil {
		ls.m = make(map[localSlotsKey]chan struct{})
	}
	if len(ls.m) >= maxLocalBuckets {
		for k, sem := range ls.m {
			if len(sem) == 0 {
				delete(ls.m, k)
			}
		}
		if len(ls.m) >= maxLocalBuckets {
			return nil, fmt.Errorf("%w: slots of more than %d buckets held locally", ErrFull, maxLocalBuckets)
		}
	}
	sem := make(chan struct{}, share)
	ls.m[k] = sem
	return sem, nil
}
