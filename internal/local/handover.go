package local

import (
	"context"

	"github.com/sharedquota/quota/internal/store"
)

// Settle hands the shared buckets, when they resume, the state of the
// local shares: a layer holds at most what this worker's share holds,
// times workers, so that a bucket Redis forgot (or kept from before the
// outage, full by now) does not release a burst on top of what the local
// shares just sent; and it is charged the tokens this worker's share
// promised to callers still sleeping, so that their grants and the shared
// bucket's do not overlap. Every worker does so at the instant the fleet
// agreed on (see Resume), so that no worker draws on the shared bucket
// while another still spends its local share. Then each shared daily
// layer takes what this worker's share of its day granted (SettleDays).
//
// Each layer takes one call, under its bucket's control record. failed is
// told of each call that fails, and reports whether the failure ends the
// settle (Redis is unavailable again): Settle then returns it. After any
// other failure, that layer stays as Redis has it.
func (ls *Shares) Settle(s *store.Store, workers int, failed func(error) (stop bool)) error {
	for _, sh := range ls.Shares() {
		b := store.Bucket{Name: sh.Name, Keys: []string{sh.Key}, Lims: []store.Limit{sh.Limit}, Call: []string{sh.Key, sh.First + store.ControlSuffix}}
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		err := s.Lower(ctx, b, max(sh.Tokens, 0)*float64(workers))
		if err == nil && sh.Tokens < 0 {
			err = s.Adjust(ctx, b, store.Tokens(-sh.Tokens), "")
		}
		cancel()
		if err != nil && failed(err) {
			return err
		}
	}
	return ls.SettleDays(s, failed)
}

// Hold has the buckets the local shares served grant nothing before at
// (µs, the scripts' clock), when the fleet resumes them: a Limiter that
// did not see the outage, its callers asleep on their grants meanwhile,
// would otherwise take from the shared bucket while the others still
// spend their shares. Its takes find the instant in the bucket's control
// record, and it joins the hand-over. failed is told of each call that
// fails; that bucket stays unheld.
func (ls *Shares) Hold(ctx context.Context, s *store.Store, at int64, failed func(error)) {
	held := map[string]bool{}
	for _, sh := range ls.Shares() {
		if held[sh.First] {
			continue // one record for every layer of a bucket
		}
		held[sh.First] = true
		b := store.Bucket{Name: sh.Name, Keys: []string{sh.First}, Lims: []store.Limit{sh.Limit}, Call: []string{sh.First, sh.First + store.ControlSuffix}}
		if err := s.Resuming(ctx, b, at); err != nil {
			failed(err)
		}
	}
}
