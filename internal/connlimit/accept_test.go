package connlimit

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"testing"
)

// scriptedListener answers Accept with its errors in turn, then a
// connection.
type scriptedListener struct {
	net.Listener
	errs []error
	conn net.Conn
	n    int
}

func (l *scriptedListener) Accept() (net.Conn, error) {
	l.n++
	if len(l.errs) > 0 {
		err := l.errs[0]
		l.errs = l.errs[1:]
		return nil, err
	}
	return l.conn, nil
}

var errPasses = errors.New("too many open files")

func passing(err error) bool { return errors.Is(err, errPasses) }

// TestAcceptRetrying: errors that pass are waited out and the next
// connection returned; any other error is returned at once; an ended
// context stops the waiting.
func TestAcceptRetrying(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	want := &net.TCPConn{}
	l := &scriptedListener{errs: []error{errPasses, errPasses}, conn: want}
	c, err := AcceptRetrying(context.Background(), l, log, "test", passing)
	if err != nil || c != want || l.n != 3 {
		t.Fatalf("after two passing errors: %v, %v, %d accepts", c, err, l.n)
	}

	l = &scriptedListener{errs: []error{errPasses, net.ErrClosed}, conn: want}
	if c, err := AcceptRetrying(context.Background(), l, log, "test", passing); !errors.Is(err, net.ErrClosed) || c != nil || l.n != 2 {
		t.Fatalf("a final error: %v, %v, %d accepts", c, err, l.n)
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	l = &scriptedListener{errs: []error{errPasses, errPasses}, conn: want}
	if c, err := AcceptRetrying(ctx, l, log, "test", passing); !errors.Is(err, errPasses) || c != nil || l.n != 1 {
		t.Fatalf("context ended: %v, %v, %d accepts", c, err, l.n)
	}
}
