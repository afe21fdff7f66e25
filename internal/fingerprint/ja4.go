package fingerprint

import (
	"crypto/md5"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// JA4 returns the JA4 fingerprint of the hello as FoxIO's specification
// defines it: "t", the version, "d" or "i" (SNI or not), the cipher and
// extension counts, the first ALPN's first and last character, then the
// truncated SHA-256 of the sorted cipher list and of the sorted extension
// list (SNI and ALPN left out) with the signature algorithms in wire order.
// GREASE is ignored everywhere. The hello is read off TCP, so the first
// character is always "t".
func (h *ClientHello) JA4() string {
	a, ciphers, exts := h.ja4Parts()
	return a + "_" + ja4Hash(ciphers) + "_" + ja4Hash(exts)
}

// JA4R returns JA4's raw form ("JA4_r"): the same lists unhashed.
func (h *ClientHello) JA4R() string {
	a, ciphers, exts := h.ja4Parts()
	return a + "_" + ciphers + "_" + exts
}

func (h *ClientHello) ja4Parts() (a, ciphers, exts string) {
	var cs []string
	for _, c := range h.CipherSuites {
		if !IsGREASE(c) {
			cs = append(cs, hex4(c))
		}
	}
	var es []string
	count := 0
	for _, x := range h.Extensions {
		if IsGREASE(x.Type) {
			continue
		}
		count++
		if x.Type != ExtServerName && x.Type != ExtALPN {
			es = append(es, hex4(x.Type))
		}
	}
	slices.Sort(cs)
	slices.Sort(es)
	ciphers = strings.Join(cs, ",")
	exts = strings.Join(es, ",")
	var sigs []string
	for _, s := range h.SignatureAlgorithms {
		if !IsGREASE(s) {
			sigs = append(sigs, hex4(s))
		}
	}
	if len(sigs) > 0 {
		exts += "_" + strings.Join(sigs, ",")
	}

	sni := "i"
	if _, ok := h.Extension(ExtServerName); ok {
		sni = "d"
	}
	a = "t" + ja4Version(h.maxVersion()) + sni + count2(len(cs)) + count2(count) + ja4ALPN(h.ALPN)
	return a, ciphers, exts
}

// maxVersion is the highest non-GREASE supported_versions entry, else the
// legacy version.
func (h *ClientHello) maxVersion() uint16 {
	if _, ok := h.Extension(ExtSupportedVersions); !ok {
		return h.Version
	}
	var v uint16
	for _, s := range h.SupportedVersions {
		if !IsGREASE(s) && s > v {
			v = s
		}
	}
	return v
}

func ja4Version(v uint16) string {
	switch v {
	case 0x0304:
		return "13"
	case 0x0303:
		return "12"
	case 0x0302:
		return "11"
	case 0x0301:
		return "10"
	case 0x0300:
		return "s3"
	case 0x0002:
		return "s2"
	}
	return "00"
}

// ja4ALPN is the first and last character of the first ALPN value, "00"
// without one, and the first and last hex digit of its bytes when either
// character is not alphanumeric.
func ja4ALPN(alpn []string) string {
	if len(alpn) == 0 || alpn[0] == "" {
		return "00"
	}
	first, last := alpn[0][0], alpn[0][len(alpn[0])-1]
	if !isAlnum(first) || !isAlnum(last) {
		const digits = "0123456789abcdef"
		return string([]byte{digits[first>>4], digits[last&0x0f]})
	}
	return string([]byte{first, last})
}

func isAlnum(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
}

// ja4Hash is the first 12 hex digits of the SHA-256 of s, or twelve zeros
// for an empty list.
func ja4Hash(s string) string {
	if s == "" {
		return "000000000000"
	}
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:6])
}

func hex4(v uint16) string { return fmt.Sprintf("%04x", v) }

func count2(n int) string {
	if n > 99 {
		n = 99
	}
	return fmt.Sprintf("%02d", n)
}

// JA3 returns the JA3 string (Salesforce): the legacy version, then the
// cipher suites, extensions, supported groups and point formats in wire
// order, GREASE removed, as decimal lists. JA3Hash is its MD5. Unlike JA4,
// JA3 sees Chrome's per-connection extension shuffle.
func (h *ClientHello) JA3() string {
	var b strings.Builder
	b.WriteString(strconv.Itoa(int(h.Version)))
	b.WriteByte(',')
	join16(&b, h.CipherSuites)
	b.WriteByte(',')
	types := make([]uint16, 0, len(h.Extensions))
	for _, x := range h.Extensions {
		types = append(types, x.Type)
	}
	join16(&b, types)
	b.WriteByte(',')
	join16(&b, h.SupportedGroups)
	b.WriteByte(',')
	for i, p := range h.PointFormats {
		if i > 0 {
			b.WriteByte('-')
		}
		b.WriteString(strconv.Itoa(int(p)))
	}
	return b.String()
}

// JA3Hash is the MD5 of JA3, in hex.
func (h *ClientHello) JA3Hash() string {
	sum := md5.Sum([]byte(h.JA3()))
	return hex.EncodeToString(sum[:])
}

func join16(b *strings.Builder, vs []uint16) {
	first := true
	for _, v := range vs {
		if IsGREASE(v) {
			continue
		}
		if !first {
			b.WriteByte('-')
		}
		first = false
		b.WriteString(strconv.Itoa(int(v)))
	}
}
