package mirror

import (
	"io"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// TestH2CompleteResponseSurvivesClose: an origin that answers in full
// (END_STREAM) and then sends GOAWAY and closes the connection (nginx at
// keepalive_requests, a server shutting down) has delivered a whole
// response. A body the caller had not read yet when the connection went
// must still read to its end, not fail with "connection lost".
func TestH2CompleteResponseSurvivesClose(t *testing.T) {
	cc, p := newPeer(t, nil)
	req := newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil)
	type rt struct {
		body io.ReadCloser
		err  error
	}
	got := make(chan rt, 1)
	go func() {
		resp, err := cc.RoundTrip(req)
		if err != nil {
			got <- rt{err: err}
			return
		}
		got <- rt{body: resp.Body}
	}()
	h := p.next(http2.FrameHeaders)
	id := h.Header().StreamID
	p.respond(id, false, ":status", "200", "content-length", "5")
	p.fr.WriteData(id, true, []byte("hello"))
	p.fr.WriteGoAway(id, http2.ErrCodeNo, nil)
	r := <-got
	if r.err != nil {
		t.Fatalf("round trip: %v", r.err)
	}
	p.conn.Close()
	<-cc.readDone // the connection is gone; the body was read in full before
	b, err := io.ReadAll(r.body)
	r.body.Close()
	if err != nil || string(b) != "hello" {
		t.Fatalf("a complete response read %q, %v; want \"hello\", nil", b, err)
	}
}
