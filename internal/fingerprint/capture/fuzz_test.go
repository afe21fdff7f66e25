package capture

import (
	"reflect"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// FuzzH1Scanner holds the HTTP/1.x scanner to its streaming contract: the
// heads it finds, and whether it gives up, do not depend on how the bytes
// are cut into reads.
func FuzzH1Scanner(f *testing.F) {
	f.Add("GET / HTTP/1.1\r\nHost: x\r\n\r\nPOST /p HTTP/1.1\r\nContent-Length: 2\r\n\r\nab\r\nGET /q HTTP/1.1\r\n\r\n", uint8(1))
	f.Add("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\nT: 1\r\n\r\nGET / HTTP/1.1\r\n\r\n", uint8(3))
	f.Fuzz(func(t *testing.T, s string, step uint8) {
		var whole h1Scanner
		all := whole.write([]byte(s))
		var parts h1Scanner
		var got []*fingerprint.H1Request
		n := int(step%32) + 1
		for i := 0; i < len(s); i += n {
			got = append(got, parts.write([]byte(s[i:min(i+n, len(s))]))...)
		}
		if whole.off != parts.off || !reflect.DeepEqual(all, got) {
			t.Fatalf("whole: off=%v %+v\nsteps of %d: off=%v %+v", whole.off, all, n, parts.off, got)
		}
	})
}
