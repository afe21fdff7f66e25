// Package socks is onceproxy's SOCKS5 front door: RFC 1928 CONNECT with
// RFC 1929 user/password. It owns the SOCKS5 handshake and its replies,
// the decision of what happens to each stream, and the blind tunnels; what
// lies behind the door (interception, the dedup pipeline, the upstream) it
// reaches through the Pipeline it is given, which *proxy.Server satisfies.
//
// A CONNECT gets what an HTTP proxy client's CONNECT gets. Its target is
// checked first (Pipeline.CheckTunnel: syntax, then the SSRF guard), before
// anything is dialled or looked up, and a refusal is a reply code (0x02 for
// the policy). Then the stream is sniffed: TLS and HTTP are handed over to
// be intercepted (Pipeline.InterceptTunnel: the MITM, and the same handler
// as the HTTP port); bypass hosts and other protocols (TLS whose hello
// BlindHello sends blind among them) are spliced, byte for byte and with
// half-close, to a tunnel the Pipeline dials through the upstream
// (Pipeline.DialTunnel), once. On a MITM port (Config.MITMPorts) the
// door answers at once and sniffs before it dials; on other ports it dials
// first, so that a failed dial becomes its RFC 1928 reply code. BIND and
// UDP ASSOCIATE get 0x07: UDP could not leave through the upstream
// sessions and would expose this host's address.
//
// # go-socks5
//
// github.com/things-go/go-socks5 (v0.1.0) provides the wire format
// (package statute: the greeting, the request, the reply) and the RFC 1929
// subnegotiation (UserPassAuthenticator, NoAuthAuthenticator). The door
// runs the handshake itself rather than through socks5.Server, whose
// behaviour would each need a workaround: it looks names up locally (the
// request would then carry an IP, not the name the upstream and the guard
// must see, and a name the guard refuses would reach DNS); it answers BIND
// and UDP ASSOCIATE with 0x02 when commands are filtered, where RFC 1928
// has 0x07; it falls back to no authentication when given no method; its
// SendReply turns a bound address that is not a *net.TCPAddr into "address
// type not supported"; and it closes the client connection when its
// handler returns, where an intercepted stream lives on in the proxy.
//
// One workaround remains: statute.ParseMethodRequest reads as many method
// bytes as a greeting claims before the version is checked, so the door
// peeks at the version byte first; a SOCKS4 or HTTP client pointed at the
// port then gets an answer it understands instead of a wait for bytes that
// never come.
package socks
