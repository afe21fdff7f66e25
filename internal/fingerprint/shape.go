package fingerprint

import (
	"context"
	"errors"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// A Shape is how one request looked on the wire beyond its header values:
// what an origin can fingerprint in the header section. http.Header is a
// map, so a request's Shape travels beside it.
type Shape struct {
	// HeaderOrder lists the request's header field names in wire order, as
	// the client spelled them: with their case on HTTP/1.x, lowercase on
	// HTTP/2. A name sent twice appears twice (HTTP/2 clients send each
	// cookie crumb as its own field). Pseudo-headers are not in it.
	HeaderOrder []string
	// PseudoOrder is the HTTP/2 pseudo-header order; nil on HTTP/1.x.
	PseudoOrder []string
	// Priority is the HTTP/2 HEADERS frame's priority block; nil when the
	// frame had none, and on HTTP/1.x.
	Priority *Priority
	// Connection is the HTTP/1.x Connection field's value as sent (lines
	// joined with ", "), "" when there was none. It is the one value kept
	// here: the proxy strips hop-by-hop fields before the request reaches
	// the upstream, which sends the options that still hold spelled as
	// the client spelled them ("Keep-Alive" is not "keep-alive" to an
	// origin that looks).
	Connection string
}

// H1Field is one header line of an HTTP/1.x request, as sent.
type H1Field struct {
	Name, Value string
}

// H1Request is an HTTP/1.x request head as the client sent it.
type H1Request struct {
	Method, Target, Proto string
	Fields                []H1Field
	Shape                 Shape
}

// ParseH1Head parses an HTTP/1.x request head: the request line and the
// header lines, through the empty line (CRLF or bare LF line ends, as
// net/http accepts). Folded continuation lines (obsolete, RFC 9112 §5.2)
// belong to the field before them and add no name.
//
// It runs for every request of every intercepted HTTP/1.x connection, so
// it copies the head once and every name and value is a piece of that
// copy: four allocations whatever the number of fields.
func ParseH1Head(raw []byte) (*H1Request, error) {
	head := string(raw)
	line, rest, ok := cutLine(head)
	if !ok {
		return nil, errors.New("fingerprint: h1: no request line")
	}
	method, after, ok1 := strings.Cut(line, " ")
	target, proto, ok2 := strings.Cut(after, " ")
	if !ok1 || !ok2 || method == "" || target == "" || !strings.HasPrefix(proto, "HTTP/") {
		return nil, errors.New("fingerprint: h1: malformed request line")
	}
	r := &H1Request{Method: method, Target: target, Proto: proto}
	if n := strings.Count(rest, "\n"); n > 1 {
		r.Fields = make([]H1Field, 0, n-1)
		r.Shape.HeaderOrder = make([]string, 0, n-1)
	}
	for {
		line, rest, ok = cutLine(rest)
		if !ok {
			return nil, errors.New("fingerprint: h1: head not terminated by an empty line")
		}
		if len(line) == 0 {
			if len(rest) != 0 {
				return nil, errors.New("fingerprint: h1: data after the head")
			}
			// At the end, for the value with its folded lines.
			for _, f := range r.Fields {
				if strings.EqualFold(f.Name, "Connection") {
					if r.Shape.Connection != "" {
						r.Shape.Connection += ", "
					}
					r.Shape.Connection += f.Value
				}
			}
			return r, nil
		}
		if line[0] == ' ' || line[0] == '\t' {
			if len(r.Fields) == 0 {
				return nil, errors.New("fingerprint: h1: continuation line before any field")
			}
			last := &r.Fields[len(r.Fields)-1]
			last.Value += " " + strings.TrimSpace(line)
			continue
		}
		name, value, ok := strings.Cut(line, ":")
		if !ok || !httpguts.ValidHeaderFieldName(name) { // a non-empty RFC 9110 token
			return nil, errors.New("fingerprint: h1: malformed header line")
		}
		r.Fields = append(r.Fields, H1Field{Name: name, Value: strings.TrimSpace(value)})
		r.Shape.HeaderOrder = append(r.Shape.HeaderOrder, name)
	}
}

// cutLine splits off one line ending in LF (its CR, if any, dropped).
func cutLine(s string) (line, rest string, ok bool) {
	line, rest, ok = strings.Cut(s, "\n")
	if !ok {
		return "", "", false
	}
	return strings.TrimSuffix(line, "\r"), rest, true
}

type shapeKey struct{}
type fingerprintKey struct{}

// WithShape returns ctx carrying the shape of the request it belongs to.
func WithShape(ctx context.Context, s *Shape) context.Context {
	return context.WithValue(ctx, shapeKey{}, s)
}

// ShapeFrom returns the Shape in ctx, or nil.
func ShapeFrom(ctx context.Context) *Shape {
	s, _ := ctx.Value(shapeKey{}).(*Shape)
	return s
}

// WithFingerprint returns ctx carrying the fingerprint of the client
// connection a request arrived on.
func WithFingerprint(ctx context.Context, f *Fingerprint) context.Context {
	return context.WithValue(ctx, fingerprintKey{}, f)
}

// FingerprintFrom returns the Fingerprint in ctx, or nil.
func FingerprintFrom(ctx context.Context) *Fingerprint {
	f, _ := ctx.Value(fingerprintKey{}).(*Fingerprint)
	return f
}
