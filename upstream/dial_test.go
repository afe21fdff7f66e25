package upstream_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// countingLookup answers names from a table and records every lookup.
type countingLookup struct {
	answers map[string][]netip.Addr
	mu      sync.Mutex
	asked   []string
}

func (l *countingLookup) lookup(_ context.Context, network, host string) ([]netip.Addr, error) {
	l.mu.Lock()
	l.asked = append(l.asked, network+" "+host)
	l.mu.Unlock()
	if a, ok := l.answers[host]; ok {
		return a, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

func (l *countingLookup) lookups() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.asked...)
}

// TestDirectDialsResolveThroughLookup: the names of origins dialled
// directly, for tunnels and requests, are resolved by the WithLookup
// function and nowhere else; its addresses are tried in order, the other
// family too; a literal address is never looked up; a failed lookup is a
// DialError that still says DNS.
func TestDirectDialsResolveThroughLookup(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(echo)) // on 127.0.0.1 only
	defer origin.Close()
	u, _ := url.Parse(origin.URL)
	port := u.Port()
	loop4 := netip.MustParseAddr("127.0.0.1")
	l := &countingLookup{answers: map[string][]netip.Addr{
		// 127.0.0.2 refuses (nothing listens there): the next address serves.
		"refused-first.test": {netip.MustParseAddr("127.0.0.2"), loop4},
		// ::1 refuses or is unavailable: the IPv4 family takes over.
		"v6-first.test": {netip.MustParseAddr("::1"), loop4},
		// The IPv4-mapped form LookupNetIP may return.
		"mapped.test": {netip.MustParseAddr("::ffff:127.0.0.1")},
	}}
	p, err := upstream.New(upstream.Config{}, quiet, upstream.WithLookup(l.lookup))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	for _, host := range []string{"refused-first.test", "v6-first.test", "mapped.test"} {
		c, err := p.DialContext(ctx, "tcp", net.JoinHostPort(host, port))
		if err != nil {
			t.Fatalf("%s: %v", host, err)
		}
		io.WriteString(c, "GET /t HTTP/1.0\r\n\r\n")
		b, _ := io.ReadAll(c)
		c.Close()
		if !strings.HasSuffix(string(b), "ok /t") {
			t.Errorf("%s: tunnel read %q", host, b)
		}
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://mapped.test:"+port+"/r", nil)
	resp, err := p.RoundTrip(req)
	if err != nil {
		t.Fatalf("request: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "ok /r" {
		t.Errorf("request body %q", b)
	}
	c, err := p.DialContext(ctx, "tcp", origin.Listener.Addr().String())
	if err != nil {
		t.Fatalf("literal: %v", err)
	}
	c.Close()
	_, err = p.DialContext(ctx, "tcp", "missing.test:"+port)
	var de *upstream.DialError
	var dns *net.DNSError
	if !errors.As(err, &de) || !errors.As(err, &dns) || dns.Name != "missing.test" {
		t.Errorf("failed lookup: %v, want a DialError with the DNSError", err)
	}
	want := []string{"ip refused-first.test", "ip v6-first.test", "ip mapped.test", "ip mapped.test", "ip missing.test"}
	if got := l.lookups(); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("lookups %q, want %q", got, want)
	}
}
