package server

import (
	"time"

	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
	"github.com/idemreg/idemreg/server/internal/pagetoken"
	"github.com/idemreg/idemreg/storage"
)

// MaxPageTokenBytes bounds a page_token before it is decoded.
const MaxPageTokenBytes = pagetoken.MaxBytes

// validateList checks a ListRecords request and returns the store's
// parameters and the digest of its filters. The page token is opened
// after (ListRecords), under the store's key, and only for valid filters,
// since it is checked against them.
func validateList(r *idemregv1.ListRecordsRequest) (storage.ListParams, pagetoken.Filters, error) {
	var v violations
	p := storage.ListParams{Consumer: r.GetConsumer(), Prefix: r.GetConsumerPrefix(), State: storage.State(r.GetState()),
		MinAttempt: r.GetMinAttempt()}
	switch {
	case p.Prefix:
		v.consumerPrefix("consumer", p.Consumer) // empty: every consumer
	case p.Consumer == "":
		v.add("consumer", "required: the consumer to list, or set consumer_prefix to list every consumer whose name starts with consumer")
	default:
		v.consumerPrefix("consumer", p.Consumer)
	}
	if _, ok := idemregv1.State_name[int32(r.GetState())]; !ok {
		v.add("state", "must be a State (STATE_UNSPECIFIED for any), got %d", r.GetState())
	}
	if p.MinAttempt < 0 {
		v.add("min_attempt", "must not be negative (0: any), got %d", p.MinAttempt)
	}
	if d := r.GetOlderThan(); d != nil {
		switch err := d.CheckValid(); {
		case err != nil:
			v.add("older_than", "invalid duration: %v", err)
		case d.AsDuration() < 0:
			v.add("older_than", "must not be negative, got %v", d.AsDuration())
		case d.AsDuration() > MaxListOlderThan:
			v.add("older_than", "must be at most %v, got %v", MaxListOlderThan, d.AsDuration())
		default:
			// Stores keep microseconds; both backends must see the same value.
			p.OlderThan = d.AsDuration().Truncate(time.Microsecond)
		}
	}
	switch n := r.GetPageSize(); {
	case n == 0:
		p.Limit = DefaultListPageSize
	case n < 0 || n > MaxListPageSize:
		v.add("page_size", "must be between 1 and %d, or 0 for %d, got %d", MaxListPageSize, DefaultListPageSize, n)
	default:
		p.Limit = int(n)
	}
	if n := len(r.GetPageToken()); n > pagetoken.MaxBytes {
		v.add("page_token", "must be at most %d bytes, got %d", pagetoken.MaxBytes, n)
	}
	return p, pagetoken.Digest(p), v.err()
}
