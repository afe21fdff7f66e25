package fleettest

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// PeerListener is an instance's peer listener, as the program runs it
// (without the token, which the program's listener checks), and the
// client the instance reads other instances' listeners with.
type PeerListener struct {
	Server *httptest.Server
	Client *dedup.PeerClient
	// Engine is the instance's engine, which it serves; set once the
	// engine exists (it needs Client first).
	Engine atomic.Pointer[dedup.Engine]
}

// StartPeerListener serves the engine set later on a loopback listener,
// advertises its address (the store's AdvertisePeer) and closes both when
// the test ends.
func StartPeerListener(t testing.TB, advertise func(addr string)) *PeerListener {
	p := &PeerListener{Client: dedup.NewPeerClient(dedup.PeerClientConfig{})}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.Engine.Load().PeerHandler().ServeHTTP(w, r)
	}))
	t.Cleanup(p.Server.Close)
	t.Cleanup(p.Client.Close)
	advertise(p.Server.Listener.Addr().String())
	return p
}
