package socks

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/things-go/go-socks5/statute"
)

type statusErr int

func (e statusErr) Error() string   { return fmt.Sprintf("status %d", int(e)) }
func (e statusErr) HTTPStatus() int { return int(e) }

func TestSOCKS5ReplyCode(t *testing.T) {
	sysErr := func(errno syscall.Errno) error {
		return fmt.Errorf("dial 10.0.0.1:80: %w",
			&net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", errno)})
	}
	for _, tc := range []struct {
		name string
		err  error
		want uint8
	}{
		{"refused", sysErr(syscall.ECONNREFUSED), statute.RepConnectionRefused},
		{"network unreachable", sysErr(syscall.ENETUNREACH), statute.RepNetworkUnreachable},
		{"host unreachable", sysErr(syscall.EHOSTUNREACH), statute.RepHostUnreachable},
		{"dns", fmt.Errorf("dial: %w", &net.DNSError{Err: "no such host", Name: "x.test", IsNotFound: true}), statute.RepHostUnreachable},
		{"deadline", fmt.Errorf("dial: %w", context.DeadlineExceeded), statute.RepHostUnreachable},
		{"net timeout", &net.OpError{Op: "dial", Err: os.ErrDeadlineExceeded}, statute.RepHostUnreachable},
		{"policy 403", fmt.Errorf("dial: %w", statusErr(403)), statute.RepRuleFailure},
		{"503 is not policy", fmt.Errorf("dial: %w", statusErr(503)), statute.RepServerFailure},
		{"upstream socks refused", errors.New("socks connect tcp 127.0.0.1:1->x:1: unknown error connection refused"), statute.RepConnectionRefused},
		{"upstream socks host unreachable", errors.New("unknown error host unreachable"), statute.RepHostUnreachable},
		{"upstream socks ruleset", errors.New("unknown error connection not allowed by ruleset"), statute.RepRuleFailure},
		{"other", errors.New("boom"), statute.RepServerFailure},
	} {
		if got := replyCode(tc.err); got != tc.want {
			t.Errorf("%s: replyCode(%v) = %d, want %d", tc.name, tc.err, got, tc.want)
		}
	}
}

func TestClassifyStream(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want sniffKind
		more bool
	}{
		{"", sniffSilent, true},
		{"\x16\x03\x01\x02\x00", sniffTLS, false},
		{"GET / HTTP/1.1\r\n", sniffHTTP, false},
		{"PRI * HTTP/2.0\r\n", sniffHTTP, false},
		{"BASELINE-CONTROL /x HTTP/1.1", sniffHTTP, false},
		{"GE", sniffOther, true},
		{"\x00\x01", sniffOther, false},
		{"PING\r\n", sniffOther, false},
		{"SSH-2.0-OpenSSH_9.2", sniffOther, false},
		{" GET", sniffOther, false},
		{"get / HTTP/1.1", sniffOther, false},
		{strings.Repeat("A", maxMethodLen+1), sniffOther, false},
		// Absolute-form, whole or still arriving.
		{"GET http://a/ HTTP/1.1", sniffHTTP, false},
		{"GET HTTPS://a/ HTTP/1.1", sniffHTTP, false},
		{"GET htt", sniffOther, true},
		{"GET https:/", sniffOther, true},
		{"GET ", sniffOther, true},
		{"OPTIONS * HTTP/1.1", sniffHTTP, false},
		// Other text protocols whose client speaks first, with an
		// upper-case word and a space: tunnelled.
		{"NICK alice\r\nUSER alice 0 * :A\r\n", sniffOther, false},
		{"AUTH secret\r\n", sniffOther, false},
		{"EHLO x", sniffOther, false},
		{"GET hello", sniffOther, false},
	} {
		k, more := classifyStream([]byte(tc.in))
		if k != tc.want || more != tc.more {
			t.Errorf("classifyStream(%q) = %v, %v; want %v, %v", tc.in, k, more, tc.want, tc.more)
		}
	}
}

func TestSOCKS5ConfigDefaultsAndValidate(t *testing.T) {
	d := Config{}.WithDefaults()
	if d.Listen != "" || d.AllowNoAuth {
		t.Errorf("WithDefaults touched listen/allow_no_auth: %+v", d)
	}
	if fmt.Sprint(d.MITMPorts) != "[80 443 8080 8443]" || d.SniffTimeout != 500*time.Millisecond {
		t.Errorf("defaults: %+v", d)
	}
	if err := d.Validate(); err != nil {
		t.Errorf("defaults invalid: %v", err)
	}
	if got := (Config{MITMPorts: []int{}}).WithDefaults().MITMPorts; got == nil || len(got) != 0 {
		t.Errorf("an explicitly empty mitm_ports became %v", got)
	}
	shipped := Config{Listen: DefaultListen, AllowNoAuth: true}.WithDefaults()
	if err := shipped.Validate(); err != nil {
		t.Errorf("shipped: %v", err)
	}
	err := Config{Listen: "nope", MITMPorts: []int{443, 0, 70000}, SniffTimeout: -time.Second}.Validate()
	for _, want := range []string{"listen:", "mitm_ports[1]:", "mitm_ports[2]:", "sniff_timeout:"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate error %v lacks %q", err, want)
		}
	}
}

// TestSnifferInterruptBeforeStart: the upstream's banner can be read (and
// the sniffer interrupted) before the sniff begins. The sniff must still
// end at once: a lost interrupt left client and server each waiting for
// the other to speak first.
func TestSnifferInterruptBeforeStart(t *testing.T) {
	proxySide, clientSide := net.Pipe()
	defer proxySide.Close()
	defer clientSide.Close()
	sn := &sniffer{conn: proxySide}
	sn.interrupt()
	done := make(chan sniffKind, 1)
	go func() { done <- sniff(bufio.NewReader(proxySide), sn, 0) }()
	select {
	case k := <-done:
		if k != sniffSilent {
			t.Errorf("sniff = %v, want %v", k, sniffSilent)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("an interrupt made before the sniff started was lost")
	}
	// After end the connection reads normally again.
	go clientSide.Write([]byte("x"))
	b := make([]byte, 1)
	if _, err := proxySide.Read(b); err != nil || b[0] != 'x' {
		t.Fatalf("read after the sniff: %q, %v", b, err)
	}
}

// recordingUsers is a UserStore that accepts one password and remembers
// who asked.
type recordingUsers struct{ client, user string }

func (r *recordingUsers) Verify(client, user, password string) (bool, time.Duration) {
	r.client, r.user = client, user
	return password == "right", 0
}

// TestCredentialsNameTheClient: the user store hears which client asks
// (its address, as the HTTP port counts it), so that its failure limit
// counts SOCKS5 guesses too; a throttled refusal is a refusal.
func TestCredentialsNameTheClient(t *testing.T) {
	r := &recordingUsers{}
	c := credentials{users: r}
	if !c.Valid("alice-session-1", "right", "127.0.0.2:40000") || r.client != "ip:127.0.0.2" || r.user != "alice-session-1" {
		t.Fatalf("Valid asked the store as client %q user %q", r.client, r.user)
	}
	if c.Valid("alice", "wrong", "[::1]:40000") || r.client != "ip:::1" {
		t.Fatalf("wrong password accepted, or client %q", r.client)
	}
	throttled := credentials{users: throttledUsers{}}
	if throttled.Valid("alice", "right", "127.0.0.2:1") {
		t.Fatal("a throttled client got in")
	}
}

type throttledUsers struct{}

func (throttledUsers) Verify(string, string, string) (bool, time.Duration) { return false, time.Minute }
