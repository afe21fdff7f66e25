package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// bigBody is a body of n pseudo-random bytes (incompressible, so no store
// could hold it compressed).
func bigBody(n int) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{7})
	r.Read(b)
	return b
}

// heldOrigin serves body with its length. Its first request gets the
// first held bytes at once and the rest once release is closed; later
// ones get it all at once. hits counts the requests, first announces the
// first one.
func heldOrigin(t *testing.T, body []byte, held int, release <-chan struct{}, hits *atomic.Int64) *httptest.Server {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Header().Set("Content-Type", "application/octet-stream")
		rc := http.NewResponseController(w)
		for off := 0; off < len(body); off += 256 << 10 {
			if n == 1 && off == held {
				<-release
			}
			if _, err := w.Write(body[off:min(off+256<<10, len(body))]); err != nil {
				return
			}
			rc.Flush()
		}
	}))
	t.Cleanup(origin.Close)
	return origin
}

// peerEnv is what an instance of a fleet with peer listeners adds to its
// environment: a listener on a free loopback port and the fleet's token.
func peerEnv(token string) []string {
	return []string{"ONCEPROXY_FLEET_PEER_LISTEN=127.0.0.1:0", "ONCEPROXY_FLEET_PEER_TOKEN_ENV=TEST_PEER_TOKEN", "TEST_PEER_TOKEN=" + token}
}

// redisFleetEnv is the environment of an instance of a Redis fleet under
// -race on two shared cores (see TestFleetOfThree).
// The origins here are plain HTTP: testEnv's CA file comes from a TLS
// server of its own.
func redisFleetEnv(t *testing.T, redisURL, certs string) []string {
	tlsOrigin := httptest.NewTLSServer(nil)
	t.Cleanup(tlsOrigin.Close)
	return append(testEnv(t, tlsOrigin), "ONCEPROXY_REDIS_URL="+redisURL, "ONCEPROXY_MITM_CA_DIR="+certs, "ONCEPROXY_LOG_ACCESS=false",
		"ONCEPROXY_REDIS_TIMEOUT=3s", "ONCEPROXY_REDIS_DIAL_TIMEOUT=3s", "ONCEPROXY_REDIS_LEASE=15s",
		"ONCEPROXY_PROXY_READ_HEADER_TIMEOUT=60s")
}

// stampedeBig sends n clients, spread over the proxies, to one big URL
// whose origin holds the body after its first bytes until every client
// has its response headers, then checks that every client got the body
// byte for byte and that the origin was asked once.
func stampedeBig(t *testing.T, proxies []string, origin *httptest.Server, body []byte, release chan struct{}, hits *atomic.Int64, n int) {
	t.Helper()
	type got struct {
		status int
		xcache string
		err    error
	}
	results := make(chan got, n)
	var headers sync.WaitGroup
	headers.Add(n)
	for i := range n {
		c := plainClient(proxies[i%len(proxies)], "", "")
		c.Timeout = 3 * time.Minute
		go func() {
			resp, err := c.Get(origin.URL + "/big.bin")
			headers.Done()
			if err != nil {
				results <- got{err: err}
				return
			}
			defer resp.Body.Close()
			// Compared as it streams: 60 copies of the body are not kept.
			err = sameBytes(resp.Body, body)
			results <- got{resp.StatusCode, resp.Header.Get("X-Cache"), err}
		}()
	}
	waited := make(chan struct{})
	go func() { headers.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(2 * time.Minute):
		t.Fatal("not every client got its response headers while the origin held the body")
	}
	close(release)
	counts := map[string]int{}
	for range n {
		g := <-results
		if g.err != nil || g.status != 200 {
			t.Fatalf("client: %d %s: %v", g.status, g.xcache, g.err)
		}
		counts[g.xcache]++
	}
	if hits.Load() != 1 {
		t.Fatalf("origin saw %d requests, want 1 (X-Cache %v)", hits.Load(), counts)
	}
	if counts["MISS"] != 1 || counts["COALESCED"] != n-1 {
		t.Fatalf("X-Cache counts %v", counts)
	}
}

// sameBytes reads r to its end and reports whether it held want.
func sameBytes(r io.Reader, want []byte) error {
	buf := make([]byte, 64<<10)
	off := 0
	for {
		k, err := r.Read(buf)
		if k > 0 {
			if off+k > len(want) || !bytes.Equal(buf[:k], want[off:off+k]) {
				return fmt.Errorf("bytes differ from offset %d", off)
			}
			off += k
		}
		if err == io.EOF {
			if off != len(want) {
				return fmt.Errorf("%d bytes, want %d", off, len(want))
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("after %d bytes: %w", off, err)
		}
	}
}

// peerFetches reads onceproxy_peer_fetches_total{result} from an admin
// port.
func peerFetches(t *testing.T, admin, result string) int {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	prefix := `onceproxy_peer_fetches_total{result="` + result + `"} `
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), prefix); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	t.Fatalf("no %s in /metrics", prefix)
	return 0
}

// TestFleetOfThreeBigBody runs three complete onceproxy programs on one
// redis-server, each with a peer listener and the fleet's token: 60
// clients spread over them on one 24 MB URL (over redis.max_value_bytes
// and dedup.max_body_bytes) cause one origin download. The instances that
// lost the lease read the body from the leader as it arrives (every
// client has its headers while the origin still holds the body), and
// every client gets it byte for byte.
func TestFleetOfThreeBigBody(t *testing.T) {
	body := bigBody(24_000_000)
	release := make(chan struct{})
	var hits atomic.Int64
	origin := heldOrigin(t, body, 1<<20, release, &hits)
	t.Cleanup(func() { closeOnce(release) })
	rs := redistest.Start(t)
	certs := filepath.Join(t.TempDir(), "certs")
	var proxies, admins []string
	for range 3 {
		p, a := startInstance(t, append(redisFleetEnv(t, rs.URL, certs), peerEnv("fleet-secret")...))
		proxies, admins = append(proxies, p), append(admins, a)
	}
	stampedeBig(t, proxies, origin, body, release, &hits, 60)
	ok := 0
	for _, a := range admins {
		ok += peerFetches(t, a, "ok")
		if fb := peerFetches(t, a, "fallback"); fb != 0 {
			t.Errorf("%s: %d peer fallbacks", a, fb)
		}
	}
	if ok != 2 {
		t.Fatalf("peer fetches ok over the fleet = %d, want 2 (one per follower)", ok)
	}
}

// TestPostgresFleetOfThreeBigBody is TestFleetOfThreeBigBody on one
// PostgreSQL schema.
func TestPostgresFleetOfThreeBigBody(t *testing.T) {
	body := bigBody(24_000_000)
	release := make(chan struct{})
	var hits atomic.Int64
	origin := heldOrigin(t, body, 1<<20, release, &hits)
	t.Cleanup(func() { closeOnce(release) })
	url, schema := pgtest.Schema(t)
	certs := filepath.Join(t.TempDir(), "certs")
	var proxies []string
	logs := &logbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("instance logs:\n%s", logs)
		}
	})
	for range 3 {
		env := append(pgEnv(t, url, schema, "ONCEPROXY_POSTGRES_TIMEOUT=3s", "ONCEPROXY_MITM_CA_DIR="+certs), peerEnv("fleet-secret")...)
		p, _ := startLogged(t, env, logs)
		proxies = append(proxies, p)
	}
	stampedeBig(t, proxies, origin, body, release, &hits, 60)
}

// TestPeerTokenRefusedFallsBack: an instance whose token the leader does
// not share is refused by the leader's peer listener and fetches the body
// itself: one more download, complete bodies, and the fallback in
// onceproxy_peer_fetches_total.
func TestPeerTokenRefusedFallsBack(t *testing.T) {
	body := bigBody(4 << 20)
	release := make(chan struct{})
	var hits atomic.Int64
	origin := heldOrigin(t, body, 1<<20, release, &hits)
	t.Cleanup(func() { closeOnce(release) })
	rs := redistest.Start(t)
	certs := filepath.Join(t.TempDir(), "certs")
	pa, adminA := startInstance(t, append(redisFleetEnv(t, rs.URL, certs), peerEnv("one-token")...))
	pb, adminB := startInstance(t, append(redisFleetEnv(t, rs.URL, certs), peerEnv("another-token")...))
	leader, err := plainClient(pa, "", "").Get(origin.URL + "/big.bin")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	const n = 3
	errs := make(chan error, n)
	for range n {
		c := plainClient(pb, "", "")
		c.Timeout = time.Minute
		go func() {
			resp, err := c.Get(origin.URL + "/big.bin")
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			errs <- sameBytes(resp.Body, body)
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatalf("B's client: %v", err)
		}
	}
	close(release)
	if err := sameBytes(leader.Body, body); err != nil {
		t.Fatalf("A's client: %v", err)
	}
	if hits.Load() != 2 {
		t.Fatalf("origin saw %d requests, want 2 (A's, B's own)", hits.Load())
	}
	if fb := peerFetches(t, adminB, "fallback"); fb != 1 {
		t.Fatalf("B's peer fallbacks = %d, want 1", fb)
	}
	if ok := peerFetches(t, adminA, "ok") + peerFetches(t, adminB, "ok"); ok != 0 {
		t.Fatalf("peer fetches ok = %d with refused tokens", ok)
	}
}

// TestPeerLeaderKilled runs three onceproxy processes on one redis-server
// with peer listeners. The leader of a 24 MB download is killed (SIGKILL)
// while the other two instances' clients are reading the body from it:
// each of them finishes the body from the origin itself, checked against
// the bytes its clients already have, and every client gets a complete,
// correct body.
func TestPeerLeaderKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "onceproxy")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	body := bigBody(24_000_000)
	release := make(chan struct{})
	var hits atomic.Int64
	origin := heldOrigin(t, body, 4<<20, release, &hits)
	t.Cleanup(func() { closeOnce(release) }) // before the origin closes, which waits for its handlers
	rs := redistest.Start(t)
	certs := filepath.Join(t.TempDir(), "certs")

	cfg := writeConfig(t, "log: {format: json}\n")
	start := func(name string) *proc {
		return runBinary(t, name, bin, cfg, append(redisFleetEnv(t, rs.URL, certs), peerEnv("fleet-secret")...))
	}
	a, b, c := start("a"), start("b"), start("c")

	// A leads: its client's request reaches the origin first.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, origin.URL+"/big.bin", nil)
	go func() {
		if resp, err := plainClient(a.proxyAddr, "", "").Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	testkit.Eventually(t, testkit.Patience, func() bool { return hits.Load() == 1 }, "A's request at the origin")
	const per = 5
	results := make(chan error, 2*per)
	var heads sync.WaitGroup
	heads.Add(2 * per)
	for _, p := range []*proc{b, c} {
		for range per {
			cl := plainClient(p.proxyAddr, "", "")
			cl.Timeout = 3 * time.Minute
			go func() {
				resp, err := cl.Get(origin.URL + "/big.bin")
				if err != nil {
					heads.Done()
					results <- err
					return
				}
				defer resp.Body.Close()
				head := make([]byte, 2<<20)
				_, err = io.ReadFull(resp.Body, head)
				heads.Done()
				if err == nil && !bytes.Equal(head, body[:len(head)]) {
					err = fmt.Errorf("first bytes differ")
				}
				if err == nil {
					err = sameBytes(resp.Body, body[len(head):])
				}
				results <- err
			}()
		}
	}
	// Every follower's client has part of the body, which came from A
	// (the origin still holds everything past its first 4 MB for A).
	heads.Wait()
	if err := a.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for range 2 * per {
		if err := <-results; err != nil {
			t.Fatalf("client of a surviving instance: %v", err)
		}
	}
	if hits.Load() != 3 {
		t.Fatalf("origin saw %d requests, want 3 (the killed leader's, one per follower)", hits.Load())
	}
	for _, p := range []*proc{b, c} {
		if fb := peerFetches(t, p.admin, "fallback"); fb != 1 {
			t.Errorf("%s: %d peer fallbacks, want 1", p.admin, fb)
		}
	}
}

func closeOnce(ch chan struct{}) {
	select {
	case <-ch:
	default:
		close(ch)
	}
}
