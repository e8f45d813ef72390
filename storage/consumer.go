package storage

import "fmt"

// MaxConsumerBytes bounds a consumer name (the API's limit, documented in
// the proto).
const MaxConsumerBytes = 128

// CheckConsumer reports why s is not a consumer name or the start of one:
// at most MaxConsumerBytes of [A-Za-z0-9._:/-]. The server checks every
// request's consumer with it, and the config file every name, prefix and
// pattern, so that a rule no request can match is refused.
func CheckConsumer(s string) error {
	if len(s) > MaxConsumerBytes {
		return fmt.Errorf("must be at most %d bytes, got %d", MaxConsumerBytes, len(s))
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			c == '.' || c == '_' || c == ':' || c == '/' || c == '-') {
			return fmt.Errorf("must contain only [A-Za-z0-9._:/-], found %q at byte %d", c, i)
		}
	}
	return nil
}
