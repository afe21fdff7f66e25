// Package httpstatus is the one way an error says which HTTP status it
// deserves. An error anywhere in onceproxy (a refused target, an exhausted
// session pool, an unknown session id) implements Carrier; the edges that
// answer clients (the proxy port, the SOCKS5 door's reply codes, the admin
// API) read it with Of, through any wrapping.
package httpstatus

import "errors"

// Carrier is an error that knows its HTTP status.
type Carrier interface {
	HTTPStatus() int
}

// Of returns the status carried by err or by an error it wraps, and false
// when none does.
func Of(err error) (int, bool) {
	var c Carrier
	if errors.As(err, &c) {
		return c.HTTPStatus(), true
	}
	return 0, false
}
