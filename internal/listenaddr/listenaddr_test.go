package listenaddr

import "testing"

func TestCheck(t *testing.T) {
	for _, ok := range []string{"127.0.0.1:8080", ":0", "[::1]:9090", "localhost:65535", "0.0.0.0:1", "127.0.0.1:080"} {
		if err := Check(ok); err != nil {
			t.Errorf("Check(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"127.0.0.1:99999", "localhost:abc", "127.0.0.1", ":-1", "127.0.0.1:+80", "127.0.0.1:"} {
		if err := Check(bad); err == nil {
			t.Errorf("Check(%q) = nil", bad)
		}
	}
}

func TestLoopback(t *testing.T) {
	for _, yes := range []string{"127.0.0.1:9090", "localhost:9090", "LOCALHOST", "[::1]:9090", "::1", "127.0.0.2", "localhost."} {
		if !Loopback(yes) {
			t.Errorf("Loopback(%q) = false", yes)
		}
	}
	for _, no := range []string{"0.0.0.0:9090", "evil.example:9090", "10.0.0.1", "[::]:80", "localhost.evil.example", ""} {
		if Loopback(no) {
			t.Errorf("Loopback(%q) = true", no)
		}
	}
}
