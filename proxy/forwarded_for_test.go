package proxy_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy"
)

// TestBalancerHeadersNotForwarded: with proxy.trust_forwarded_for the
// X-Forwarded-For / X-Real-IP fields are the balancer's word to the proxy
// about who its client is (handler.go clientAddr reads them); they are
// consumed there and do not travel on to every origin, which would then
// see the scraper's own address behind the exit IP.
func TestBalancerHeadersNotForwarded(t *testing.T) {
	seen := make(chan http.Header, 1)
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Header.Clone()
	}))
	w := newWorld(t, worldOpts{proxy: proxy.Config{TrustForwardedFor: true}})
	c, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	host := strings.TrimPrefix(origin.URL, "http://")
	fmt.Fprintf(c, "GET %s/x HTTP/1.1\r\nHost: %s\r\nX-Forwarded-For: 203.0.113.7\r\nX-Real-IP: 203.0.113.7\r\n\r\n", origin.URL, host)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	h := <-seen
	for _, k := range []string{"X-Forwarded-For", "X-Real-Ip"} {
		if v := h.Get(k); v != "" {
			t.Errorf("the origin received the balancer's %s: %q (the client's own address)", k, v)
		}
	}
}
