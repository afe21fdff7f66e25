package netguard_test

import (
	"errors"
	"fmt"
	"net"

	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
)

func ExampleGuard_CheckHost() {
	g, err := netguard.New(netguard.Config{AllowCIDRs: []string{"10.1.0.0/16"}})
	if err != nil {
		panic(err)
	}
	for _, host := range []string{"example.com", "0x7f.1", "10.1.2.3", "[::ffff:a9fe:a9fe]"} {
		err := g.CheckHost(host)
		var be *netguard.BlockedError
		if errors.As(err, &be) {
			fmt.Printf("%s: %d %s\n", host, be.HTTPStatus(), be.Class)
			continue
		}
		fmt.Printf("%s: ok\n", host)
	}
	// Output:
	// example.com: ok
	// 0x7f.1: 403 loopback
	// 10.1.2.3: ok
	// [::ffff:a9fe:a9fe]: 403 ipv4-mapped(link-local)
}

// The dial-time check: the dialer refuses to connect to a non-public address
// whatever name resolved to it. (Not run: this package's tests never dial.)
func ExampleGuard_Control() {
	g, err := netguard.New(netguard.Config{})
	if err != nil {
		panic(err)
	}
	dialer := &net.Dialer{ControlContext: g.Control}
	_ = dialer // used by the proxy's http.Transport and CONNECT tunnels
}
