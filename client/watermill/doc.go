// Package watermill de-duplicates the messages of a Watermill handler
// through the idemreg registry: a message.HandlerMiddleware that runs the
// handler once per key with client.Consumer's semantics, acknowledges a
// message only once its outcome is stored in the registry, asks for a
// redelivery (a nack) after a retryable failure, and replays to a
// duplicate what the first run produced instead of running the handler
// again.
//
// It is a module of its own (github.com/idemreg/idemreg/client/watermill),
// so that a service importing package client takes none of Watermill's
// requirements. Import it under another name than Watermill's own package:
//
//	import idemwm "github.com/idemreg/idemreg/client/watermill"
package watermill
