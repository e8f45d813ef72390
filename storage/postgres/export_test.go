package postgres

// ClaimSQL is the Claim statement, for the plan test.
var ClaimSQL = claimSQL

// BatchStats reports how many multi-call statements the store sent and how
// many calls they carried.
func BatchStats(s *Store) (batches, calls int64) {
	return s.coalescer.batches.Load(), s.coalescer.batchedCalls.Load()
}

// BatchSplits reports how many batches were split after a serialization
// failure or a deadlock.
func BatchSplits(s *Store) int64 { return s.coalescer.splits.Load() }

// Coalescing reports the statements in flight and the calls queued.
func Coalescing(s *Store) (inFlight, queued int) {
	c := s.coalescer
	c.mu.Lock()
	defer c.mu.Unlock()
	return s.claims.inFlight + s.completes.inFlight, len(s.claims.pending) + len(s.claims.deferred) +
		len(s.completes.pending) + len(s.completes.deferred)
}

// StaleReads reports how many statements (or batch members) ran again
// because their pre-image was older than the row they declined to write.
func StaleReads(s *Store) int64 { return s.staleReads.Load() }

// MemberSplits reports how many batches were split after the database
// refused one member's input, and the most parameter bytes one batched
// statement carried.
func MemberSplits(s *Store) (splits, largestBytes int64) {
	return s.coalescer.memberSplits.Load(), s.coalescer.largestBytes.Load()
}
