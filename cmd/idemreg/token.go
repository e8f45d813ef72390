package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"flag"
	"fmt"
	"io"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/command"
	"github.com/idemreg/idemreg/server/access"
)

// newTokenCommand prints a fresh bearer token, for the client, and its
// hash, for token_hashes in the config file. Only the hash goes into the
// config.
func newTokenCommand(*flag.FlagSet) command.Run {
	return func(_ context.Context, stdout, stderr io.Writer) error {
		var b [32]byte
		if _, err := rand.Read(b[:]); err != nil {
			return err
		}
		token := "idemreg_" + base64.RawURLEncoding.EncodeToString(b[:])
		fmt.Fprintf(stdout, "token: %s\nhash:  %s\n", token, access.HashToken(token))
		fmt.Fprintln(stderr, "Give the token to the client (authorization: bearer <token>); put the hash under token_hashes in --config.")
		return nil
	}
}
