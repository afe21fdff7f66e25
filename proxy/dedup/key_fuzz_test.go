package dedup

import (
	"bytes"
	"errors"
	"net/http"
	"net/url"
	"testing"
)

func FuzzKey(f *testing.F) {
	f.Add("GET", "https://e.com/p?b=2&a=1", "Accept", "text/html", "a=1; b=2", "", "u", "", []byte(nil), uint8(0))
	f.Add("POST", "http://e.com/in.php", "Authorization", "Bearer x", "sid=1;;", "method=a&key=1", "", "DE", []byte("method=a&key=1"), uint8(1))
	f.Add("post", "http://e.com/api", "Range", "bytes=0-1", "", "", "", "", []byte(`{"method":{"b":1,"a":[1,{"y":2,"x":3}]},"key":1}`), uint8(2))
	f.Add("PUT", "http://e.com/api", "If-None-Match", `"x"`, "", "", "", "US", []byte(`{"method":"a","method":"b"}`), uint8(3))
	f.Add("", "http://[::1]:443/%2e%2E", "X-Custom", " v ", "a=1; a=2", "", "", "", []byte(`{"\ud800":1}`), uint8(4))
	specs := []*KeySpec{
		nil,
		{Body: true, BodyFields: []string{"method", "googlekey", "pageurl"}},
		{Body: true, BodyFields: []string{"method", "a"}, Headers: []string{"X-Custom", "accept-encoding"}},
		{Body: true, ShareCredentials: true, IgnoreParams: []string{"*"}},
		{ShareCountries: true},
		{Headers: []string{}, IgnoreParams: []string{}},
	}
	contentTypes := []string{"", "application/x-www-form-urlencoded", "application/json", "application/ld+json; charset=utf-8", "text/plain"}
	f.Fuzz(func(t *testing.T, method, raw, hname, hval, cookie, auth, user, country string, body []byte, sel uint8) {
		u, err := url.Parse(raw)
		if err != nil {
			u = &url.URL{Scheme: "http", Host: "e.com", Path: raw}
		}
		h := http.Header{}
		h.Add(hname, hval)
		h.Add("Cookie", cookie)
		h.Add("Authorization", auth)
		if ct := contentTypes[int(sel)%len(contentTypes)]; ct != "" {
			h.Set("Content-Type", ct)
		}
		spec := specs[int(sel/8)%len(specs)]
		k := NewKeyer(spec)
		who := Requester{Account: user, Country: country}
		k1, err1 := k.Key(method, u, h, who, body)
		k2, err2 := k.Key(method, u, h, who, bytes.Clone(body))
		if k1 != k2 || (err1 == nil) != (err2 == nil) {
			t.Fatalf("Key not deterministic: %q, %v vs %q, %v", k1, err1, k2, err2)
		}
		if err1 != nil {
			if !errors.Is(err1, ErrInvalidURL) {
				t.Fatalf("Key error %v does not wrap ErrInvalidURL", err1)
			}
			return
		}
		if !keyPattern.MatchString(k1) {
			t.Fatalf("Key = %q, bad format", k1)
		}
		// Accept-Encoding never counts.
		h2 := h.Clone()
		h2.Set("Accept-Encoding", hval+"x")
		if k2, _ := k.Key(method, u, h2, who, body); k2 != k1 {
			t.Fatalf("Accept-Encoding changed the key")
		}
		// Credentials always count, unless shared.
		h3 := h.Clone()
		h3.Set("Authorization", auth+"x")
		k3, _ := k.Key(method, u, h3, who, body)
		k4, _ := k.Key(method, u, h, Requester{Account: user + "x", Country: country}, body)
		shared := spec != nil && spec.ShareCredentials
		if shared != (k3 == k1) || shared != (k4 == k1) {
			t.Fatalf("credentials: shared=%v, but key with other Authorization equal=%v, other user equal=%v", shared, k3 == k1, k4 == k1)
		}
		// The country counts, unless shared; asking for none is its own key.
		k5, _ := k.Key(method, u, h, Requester{Account: user, Country: country + "x"}, body)
		k6, _ := k.Key(method, u, h, Requester{Account: user}, body)
		sharedGeo := spec != nil && spec.ShareCountries
		if sharedGeo != (k5 == k1) || (country != "" && sharedGeo != (k6 == k1)) {
			t.Fatalf("countries: shared=%v, but key with another country equal=%v, with none equal=%v", sharedGeo, k5 == k1, k6 == k1)
		}
	})
}
