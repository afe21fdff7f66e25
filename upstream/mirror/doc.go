// Package mirror opens origin connections that look like the client's own:
// the TLS handshake replays the client's ClientHello (with bogdanfinn/utls),
// and HTTP goes out in the client's version with the client's HTTP/2
// preface and header order. It is the fingerprint-faithful dialer of the
// upstream pool; package fingerprint supplies what it replays.
//
// # TLS
//
// [Dialer.DialTLS] dials the origin (directly, or through a gateway tunnel
// opened by the caller's Dial func: the hello then goes end to end inside
// it) and handshakes with a spec parsed afresh from the client's raw hello
// for every dial (a spec is stateful and fails when reused). GREASE values,
// randoms, the session id (as long as the client's, empty when it was)
// and key shares are fresh; pre_shared_key and early_data are never sent
// (the client's tickets are the proxy's). When the hello cannot be
// completed by the TLS library, the connection gets the closest hello
// that can be, and the [Report] says so:
//
//   - Mirrored: the client's hello. Extensions utls has no logic for go out
//     verbatim (listed in Report.Verbatim): an origin that does not know
//     them ignores them, which is what the client counted on too.
//   - Closest: the client's hello minus what broke: key shares of groups
//     utls cannot compute are dropped before dialing; after a handshake
//     the origin refused, the next dial also drops the verbatim and
//     advertise-only extensions and the groups utls lacks.
//   - Go: a default hello keeping the client's ALPN list, when the
//     client's did not parse or the closest one failed as well.
//
// A refused handshake is retried on a new connection with the next rung;
// a certificate the origin's chain fails verification with, a handshake
// that timed out, a cancelled context or a failed dial is not. utls keeps
// a private key for one classical key share only: when the origin picks
// another of the client's shares (P-256 from Firefox's X25519 and P-256),
// the client's hello is sent again with the key on the next share before
// any rung is given up. The rung (and that share) that worked is
// remembered per hello and server name. The hello's record carries the
// client's record-layer version.
//
// # HTTP
//
// [NewClientConn] speaks what ALPN chose. HTTP/1.1 ([H1Conn]) writes the
// request line and the headers itself, in the client's order and case
// (net/http sorts and canonicalizes them). HTTP/2 ([H2Conn]) is a client of
// its own on x/net's Framer and HPACK: it sends the client's SETTINGS
// (ids, values, order), connection WINDOW_UPDATE, PRIORITY frames, first
// stream id, per-request HEADERS priority and pseudo-header order, and
// grants the peer exactly the windows those settings announce. fhttp's
// HTTP/2 transport can send the same preface but credits a stream 4 MiB
// whatever INITIAL_WINDOW_SIZE it advertised: with Chrome's 6 MiB the
// connection dies with FLOW_CONTROL_ERROR on large bodies, even read at
// full speed, and it adds an accept-encoding the client never sent.
//
// A request's header order comes from the [fingerprint.Shape] in its
// context ([fingerprint.WithShape]); without one, headers are sorted.
package mirror
