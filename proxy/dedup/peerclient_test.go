package dedup

import (
	"net/url"
	"strings"
	"testing"
)

// peerURLNames reports whether the URL askPeer builds for addr names addr
// as its host and the object as its path: the follower dials the address
// the lease named and no other, and sends the fleet's token there only.
func peerURLNames(addr string) bool {
	key := "v1:" + strings.Repeat("0", 64)
	u, err := url.Parse("http://" + addr + PeerPath + key)
	return err == nil && u.Host == addr && u.Path == PeerPath+key && u.User == nil && u.RawQuery == "" && u.Fragment == ""
}

// TestValidPeerAddr: the addresses instances advertise are valid; what is
// not a host and a port is not, in particular what would end the URL's
// authority early ('/', '?', '#', '@'): "127.0.0.1/x:7000" used to pass,
// and the follower then sent its request, bearer token included, to port
// 80 of 127.0.0.1.
func TestValidPeerAddr(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:7000":              true,
		"[::1]:7000":                  true,
		"10.1.2.3:65535":              true,
		"onceproxy-2:7000":            true,
		"onceproxy_peer.svc.local:80": true,
		"Peer.Example:7000":           true,

		"127.0.0.1/x:7000":      false,
		"127.0.0.1#:7000":       false,
		"127.0.0.1?:7000":       false,
		"user@127.0.0.1:7000":   false,
		"127.0.0.1%2f:7000":     false,
		"peer host:7000":        false,
		"[fe80::1%eth0]:7000":   false,
		"127.0.0.1:+7000":       false,
		"127.0.0.1: 7000":       false,
		"127.0.0.1:0":           false,
		"127.0.0.1:65536":       false,
		":7000":                 false,
		"127.0.0.1":             false,
		"[127.0.0.1:7000/]:700": false,
	} {
		if got := ValidPeerAddr(addr); got != want {
			t.Errorf("ValidPeerAddr(%q) = %v, want %v", addr, got, want)
		}
		if want && !peerURLNames(addr) {
			t.Errorf("%q: the peer URL does not name it", addr)
		}
	}
}

// FuzzValidPeerAddr: whatever address ValidPeerAddr accepts is the host of
// the URL the follower requests, whole: read from a shared store, it can
// point the follower at that address only.
func FuzzValidPeerAddr(f *testing.F) {
	for _, s := range []string{"127.0.0.1:7000", "[::1]:1", "h:80", "a/b:1", "a#:1", "[a]:1", "u@h:1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, addr string) {
		if ValidPeerAddr(addr) && !peerURLNames(addr) {
			t.Fatalf("ValidPeerAddr(%q) is true, but the peer URL names another host or path", addr)
		}
	})
}
