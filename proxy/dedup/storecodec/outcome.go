package storecodec

import (
	"fmt"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// An outcome value is a kind byte, then an encoded entry or a message: what
// a flight's waiters on other instances read when its response is not (or
// cannot be) stored as the cached value.
const (
	outcomeEntry   = 'E'
	outcomeError   = 'X'
	outcomeTimeout = 'T'
)

// EncodeSharedOutcome is EncodeOutcome for a store that takes at most
// maxOutcome bytes of it and whose readers decode bodies of at most
// BodyLimit(maxValue): an outcome past either is shared as TooLarge, so
// that the waiters fetch their own copy rather than answer their clients
// with an error for a response that is there to fetch.
func EncodeSharedOutcome(out dedup.Outcome, maxOutcome, maxValue int64) []byte {
	b := EncodeOutcome(out)
	if int64(len(b)) > maxOutcome || out.Entry != nil && int64(len(out.Entry.Body)) > BodyLimit(maxValue) {
		return EncodeOutcome(dedup.TooLarge(nil))
	}
	return b
}

// EncodeOutcome serializes a flight's outcome. Cached is not kept: it
// describes how a reader found the outcome, not the outcome.
func EncodeOutcome(out dedup.Outcome) []byte {
	switch {
	case out.Entry != nil:
		return append([]byte{outcomeEntry}, Encode(out.Entry)...)
	case out.Timeout:
		return append([]byte{outcomeTimeout}, out.Err...)
	default:
		return append([]byte{outcomeError}, out.Err...)
	}
}

// DecodeOutcome parses a value written by EncodeOutcome, with entry bodies
// of at most maxBody bytes; anything else is ErrFormat.
func DecodeOutcome(b []byte, maxBody int64) (*dedup.Outcome, error) {
	if len(b) == 0 {
		return nil, ErrFormat
	}
	switch b[0] {
	case outcomeEntry:
		e, err := DecodeLimit(b[1:], maxBody)
		if err != nil {
			return nil, err
		}
		return &dedup.Outcome{Entry: e}, nil
	case outcomeError, outcomeTimeout:
		return &dedup.Outcome{Err: string(b[1:]), Timeout: b[0] == outcomeTimeout}, nil
	}
	return nil, fmt.Errorf("%w: outcome kind %q", ErrFormat, b[0])
}
