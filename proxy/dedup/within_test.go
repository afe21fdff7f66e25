package dedup

import (
	"context"
	"errors"
	"testing"
)

// TestWithinOutlivesTheRequest: a flight's context keeps the request's
// values, ignores the request's end, and ends with the engine's life,
// whose cause context.Cause and a child's cancellation both see.
func TestWithinOutlivesTheRequest(t *testing.T) {
	type key struct{}
	req, endReq := context.WithCancel(context.WithValue(context.Background(), key{}, "client"))
	lifeCause := errors.New("life over")
	life, endLife := context.WithCancelCause(context.Background())
	ctx := within(life, req)
	child, endChild := context.WithCancel(ctx)
	defer endChild()

	if got := ctx.Value(key{}); got != "client" {
		t.Fatalf("value %v, want the request's", got)
	}
	endReq()
	if ctx.Err() != nil || child.Err() != nil {
		t.Fatalf("the request's end ended the flight: %v, %v", ctx.Err(), child.Err())
	}
	endLife(lifeCause)
	<-child.Done()
	if got := context.Cause(ctx); got != lifeCause {
		t.Fatalf("cause %v, want life's", got)
	}
	if got := context.Cause(child); got != lifeCause {
		t.Fatalf("child's cause %v, want life's", got)
	}
}
