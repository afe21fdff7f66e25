package proxy_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestOriginStatusBelow100: Go's response parser takes any three digits
// for a status, "000" and "099" included. The client gets a 502 saying the
// origin's status was no final HTTP status. Handed on, such a status made
// WriteHeader panic: the panic was recovered, logged with a stack, and the
// client's connection cut without an answer.
func TestOriginStatusBelow100(t *testing.T) {
	for _, code := range []string{"000", "099"} {
		for _, d := range []*dedup.Config{nil, dedupOn(dedup.Config{})} {
			t.Run(fmt.Sprintf("%s/dedup=%v", code, d != nil), func(t *testing.T) {
				origin := testkit.RawHTTP(t, "HTTP/1.1 "+code+" Odd\r\nContent-Length: 2\r\n\r\nhi")
				w := newWorld(t, worldOpts{dedup: d})
				for _, via := range []string{"lean loop", "net/http"} {
					c, err := net.Dial("tcp", w.proxyURL.Host)
					if err != nil {
						t.Fatal(err)
					}
					_ = c.SetDeadline(time.Now().Add(10 * time.Second))
					extra := ""
					if via == "net/http" {
						// A body is net/http's (the lean loop hands over).
						extra = "Content-Length: 1\r\n\r\nx"
					} else {
						extra = "\r\n"
					}
					method := "GET"
					fmt.Fprintf(c, "%s http://%s/x HTTP/1.1\r\nHost: %s\r\n%s", method, origin, origin, extra)
					resp, err := http.ReadResponse(bufio.NewReader(c), nil)
					c.Close()
					if err != nil {
						t.Errorf("%s: no answer: %v", via, err)
						continue
					}
					if resp.StatusCode != http.StatusBadGateway {
						t.Errorf("%s: status %d, want 502", via, resp.StatusCode)
					}
				}
				if strings.Contains(w.logs.String(), "panic") {
					t.Errorf("a panic was logged")
				}
			})
		}
	}
}
