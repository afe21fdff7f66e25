package upstream

import (
	"net/http"
	"testing"
)

func TestGatewayCouldNotReach(t *testing.T) {
	for _, tc := range []struct {
		name   string
		header http.Header
		want   string
	}{
		{"none", http.Header{}, ""},
		{"refused", http.Header{"Proxy-Status": {"gw; error=connection_refused"}}, "Proxy-Status: connection_refused"},
		{"dns", http.Header{"Proxy-Status": {`gw; error=dns_error; rcode=NXDOMAIN`}}, "Proxy-Status: dns_error"},
		// The last member is the gateway's; an earlier one is the
		// origin's own CDN, which the request reached.
		{"last member says nothing", http.Header{"Proxy-Status": {"cdn; error=destination_unavailable, gw"}}, ""},
		{"last member of two fields", http.Header{"Proxy-Status": {"cdn", "gw; error=connection_timeout"}}, "Proxy-Status: connection_timeout"},
		// An error after the request went on is no proof it did not.
		{"after sending", http.Header{"Proxy-Status": {"gw; error=http_response_timeout"}}, ""},
		{"internal", http.Header{"Proxy-Status": {"gw; error=proxy_internal_error"}}, ""},
		{"error as a string", http.Header{"Proxy-Status": {`gw; error="connection_refused"`}}, ""},
		{"unparsable", http.Header{"Proxy-Status": {"gw; error=connection_refused; ;;"}}, ""},
		{"squid", http.Header{"X-Squid-Error": {"ERR_CONNECT_FAIL 111"}}, "X-Squid-Error: ERR_CONNECT_FAIL 111"},
		{"squid dns", http.Header{"X-Squid-Error": {"ERR_DNS_FAIL 0"}}, "X-Squid-Error: ERR_DNS_FAIL 0"},
		{"squid after sending", http.Header{"X-Squid-Error": {"ERR_READ_TIMEOUT 0"}}, ""},
	} {
		if got := gatewayCouldNotReach(tc.header); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
