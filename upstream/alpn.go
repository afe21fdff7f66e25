package upstream

import (
	"net"
	"slices"
	"strings"
	"time"

	"github.com/maypok86/otter/v2"

	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
)

// alpnMemory remembers which application protocol each HTTPS origin
// chose (ALPN: "h2", "http/1.1", or "" for none) when a mirrored hello
// offered it HTTP/2, for the MITM to offer a client what its origin will
// speak (Pool.OriginProtocol). A client and its origin agree on the
// protocol in one handshake; through onceproxy the client's handshake is
// with the MITM, over before the origin is dialled, so the MITM can only
// repeat what the origin chose before.
//
// HTTP/2 sticks: once an origin chose it, it is remembered as such until
// memoryTTL passes without it being chosen again, whatever the origin's
// other connections chose meanwhile. An origin whose servers differ (a
// rollout behind a load balancer) is then offered to clients as one that
// speaks HTTP/2, as it was before this memory, rather than flip at every
// connection. An origin that turns to HTTP/2 takes, once, a connection
// for a client that spoke HTTP/1.1 to the proxy, with an HTTP/2 preface
// of the proxy's own (the client sent none), before the memory follows.
//
// Entries keep their own time rather than an expiry of the cache's, which
// would cost a clean-up goroutine for the pool to stop.
type alpnMemory struct {
	c   *otter.Cache[string, chosen]
	now func() time.Time
}

// chosen is what an origin chose, and when.
type chosen struct {
	proto string
	at    time.Time
}

const (
	// memoryOrigins bounds the origins remembered: the most recent ones.
	memoryOrigins = 10_000
	// memoryTTL is how long an origin's choice counts without being seen
	// again.
	memoryTTL = time.Hour
)

func newALPNMemory() *alpnMemory {
	return &alpnMemory{
		c:   otter.Must(&otter.Options[string, chosen]{MaximumSize: memoryOrigins}),
		now: time.Now,
	}
}

// record notes that the origin at addr (host:port) chose proto when
// offered offered.
func (m *alpnMemory) record(addr string, offered []string, proto string) {
	if m == nil || !slices.ContainsFunc(offered, func(p string) bool { return strings.EqualFold(p, "h2") }) {
		// An offer without HTTP/2 says nothing of whether the origin
		// speaks it.
		return
	}
	key, now := originKey(addr), m.now()
	if proto != "h2" {
		if prev, ok := m.c.GetIfPresent(key); ok && prev.proto == "h2" && now.Sub(prev.at) < memoryTTL {
			return // HTTP/2 sticks (see alpnMemory)
		}
	}
	m.c.Set(key, chosen{proto: proto, at: now})
}

// protocol returns what the origin at addr chose, if known.
func (m *alpnMemory) protocol(addr string) (string, bool) {
	if m == nil {
		return "", false
	}
	c, ok := m.c.GetIfPresent(originKey(addr))
	if !ok || m.now().Sub(c.at) >= memoryTTL {
		return "", false
	}
	return c.proto, true
}

// originKey is addr as the MITM (a tunnel's CONNECT target) and the
// transport (a request's URL) both name it: host names are
// case-insensitive, and a trailing dot names the same host.
func originKey(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return strings.ToLower(addr)
	}
	return net.JoinHostPort(hostmatch.Normalize(host), port)
}

// OriginProtocol reports which application protocol the HTTPS origin at
// addr (host:port) chose the last time a client's mirrored hello offered
// it HTTP/2 ("h2", "http/1.1", "" for none), and whether that is known: an
// origin this process has not reached in the last hour, or reached only
// with offers without HTTP/2, is not.
func (p *Pool) OriginProtocol(addr string) (string, bool) {
	return p.kit.alpn.protocol(addr)
}
