package watermill

import (
	"encoding/json"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ResultType is the type the middleware stores its outcomes under
// (Response.Type), for an operator reading a record with `idemreg admin
// inspect`: a JSON object whose "messages" are the produced messages
// (uuid, metadata, payload as base64), or, when they did not fit,
// "omitted", their count. A handler that produced nothing stores no data.
const ResultType = "idemreg.watermill.ProducedMessages+json"

// MaxReplayBytes bounds the encoded produced messages stored with an
// outcome, below the registry's default bound on a stored result (1 MiB).
// Beyond it only their count is stored: the first run still returns them
// to the router, but a duplicate publishes none.
const MaxReplayBytes = 768 << 10

type storedOutcome struct {
	Messages []storedMessage `json:"messages,omitempty"`
	Omitted  int             `json:"omitted,omitempty"`
}

type storedMessage struct {
	UUID     string            `json:"uuid"`
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload,omitempty"`
}

// encodeMessages is the data stored for a handler's produced messages, and
// their count when they were too large to store.
func encodeMessages(msgs []*message.Message) ([]byte, int, error) {
	if len(msgs) == 0 {
		return nil, 0, nil
	}
	out := storedOutcome{Messages: make([]storedMessage, len(msgs))}
	for i, m := range msgs {
		out.Messages[i] = storedMessage{UUID: m.UUID, Metadata: m.Metadata, Payload: m.Payload}
	}
	data, err := json.Marshal(out)
	if err != nil {
		return nil, 0, fmt.Errorf("idemreg/watermill: encode produced messages: %w", err)
	}
	if len(data) <= MaxReplayBytes {
		return data, 0, nil
	}
	data, err = json.Marshal(storedOutcome{Omitted: len(msgs)})
	return data, len(msgs), err
}

// decodeMessages rebuilds the produced messages from stored data, new
// messages with the first run's UUIDs, metadata and payloads.
func decodeMessages(data []byte) ([]*message.Message, int, error) {
	if len(data) == 0 {
		return nil, 0, nil
	}
	var in storedOutcome
	if err := json.Unmarshal(data, &in); err != nil {
		return nil, 0, fmt.Errorf("idemreg/watermill: the stored outcome is not the middleware's (%s): %w", ResultType, err)
	}
	msgs := make([]*message.Message, len(in.Messages))
	for i, m := range in.Messages {
		msgs[i] = message.NewMessage(m.UUID, m.Payload)
		for k, v := range m.Metadata {
			msgs[i].Metadata.Set(k, v)
		}
	}
	return msgs, in.Omitted, nil
}
