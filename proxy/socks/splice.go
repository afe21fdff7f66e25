package socks

import (
	"context"
	"io"
	"net"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
)

// Splice copies both ways between the client and the upstream until both
// directions end, byte for byte. An EOF from one side becomes a half-close
// (CloseWrite) towards the other, so request-then-response protocols that
// shut their sending side still get their answer; an error on either side
// closes both, since the other direction may wait on a peer that is gone.
// fromClient and fromUp read the two connections (with bytes already
// buffered by sniffing). When ctx ends (Shutdown) both are closed: cutting
// the client alone would leave a copy blocked on an upstream that has
// nothing to say. The HTTP proxy's CONNECT tunnels that turn out to be
// neither TLS nor HTTP are spliced with it too.
func Splice(ctx context.Context, client net.Conn, fromClient io.Reader, up net.Conn, fromUp io.Reader) error {
	stop := context.AfterFunc(ctx, func() {
		client.Close()
		up.Close()
	})
	defer stop()
	errc := make(chan error, 2)
	go func() {
		_, err := io.Copy(up, fromClient)
		halfClose(up)
		errc <- err
	}()
	go func() {
		_, err := io.Copy(client, fromUp)
		halfClose(client)
		errc <- err
	}()
	var first error
	for range 2 {
		if err := <-errc; err != nil && first == nil {
			first = err
			client.Close()
			up.Close()
		}
	}
	client.Close()
	up.Close()
	return first
}

// halfClose passes an EOF on to c when the connection under the wrappers
// can half-close. When it cannot (a connection that is not TCP underneath),
// c stays open rather than being closed: a full close would drop the answer
// still on its way back. The tunnel then ends when the other side closes,
// or when it idles.
func halfClose(c net.Conn) {
	if halfclose.Supported(c) {
		_ = halfclose.CloseWrite(c)
	}
}
