package main

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
)

// Payment is the message the consumer applies: "debit account by
// amount_minor", identified by the payment id its producer gave it once.
// A re-publication of the same payment carries the same id.
type Payment struct {
	ID          string `json:"payment_id"`
	Account     string `json:"account"`
	AmountMinor int64  `json:"amount_minor"`
}

func decodePayment(data []byte) (Payment, error) {
	var p Payment
	if err := json.Unmarshal(data, &p); err != nil {
		return p, fmt.Errorf("payment: %w", err)
	}
	if p.ID == "" {
		return p, errors.New("payment: payment_id is required")
	}
	return p, nil
}

// validate reports a payment no retry can make valid.
func (p Payment) validate() error {
	switch {
	case p.Account == "":
		return errors.New("payment: account is required")
	case p.AmountMinor <= 0:
		return fmt.Errorf("payment: amount_minor must be positive, got %d", p.AmountMinor)
	}
	return nil
}

// fingerprint is the hash of the message body: a message with a known
// payment id but another body is refused, not taken for a duplicate.
func fingerprint(data []byte) []byte {
	h := sha256.Sum256(data)
	return h[:]
}
