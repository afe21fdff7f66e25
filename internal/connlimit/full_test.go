package connlimit

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestFullListenerShedsIdleForWaitingClient: connections that fill every
// slot at once (a burst of CONNECTs) are too fresh to shed when accepted;
// once they have gone silent, a client waiting for a slot gets the idlest
// one's, as below the cap. It used to wait for the idle timeout (none
// here: for ever): a full listener accepted nothing, so nothing was shed.
func TestFullListenerShedsIdleForWaitingClient(t *testing.T) {
	ln, l := listen(t, Config{MaxConns: 2}) // high water: 1
	dialFrom(t, ln, "127.0.0.1")
	busy := acceptOne(t, l, "127.0.0.1")
	SetBusy(busy, true) // serving a request: never shed
	dialFrom(t, ln, "127.0.0.2")
	silent := acceptOne(t, l, "127.0.0.2")
	if st := l.Stats(); st.Shed != 0 || st.Live != 2 {
		t.Fatalf("stats %+v after the burst, want 2 live, none shed", st)
	}

	dialFrom(t, ln, "127.0.0.3")
	waiting := accept(t, l)
	select {
	case c := <-waiting:
		if c == nil {
			t.Fatal("Accept failed")
		}
	case <-time.After(testkit.Patience):
		t.Fatal("a client waiting for a slot of a full listener of silent connections was never accepted")
	}
	if _, err := silent.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("the silent connection was not shed: %v", err)
	}
	_ = busy.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	var ne net.Error
	if _, err := busy.Read(make([]byte, 1)); !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("the busy connection was shed: %v", err)
	}
	if st := l.Stats(); st.Shed != 1 || st.Live != 2 {
		t.Fatalf("stats %+v, want 1 shed, 2 live", st)
	}
}
