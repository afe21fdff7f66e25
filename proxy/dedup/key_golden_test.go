package dedup

import (
	"net/http"
	"strings"
	"testing"
)

// The golden tables pin key v1 byte for byte. Every cached entry, every fleet
// lease and every X-Cache-Key an operator holds is one of these hashes, and
// proxies of different builds share one store: a change here orphans them
// all. Never edit a want; change the key only with a new keyVersion.

var (
	goldenForm    = http.Header{"Content-Type": {"application/x-www-form-urlencoded"}}
	goldenJSON    = http.Header{"Content-Type": {"application/json"}}
	goldenCaptcha = &KeySpec{Body: true, BodyFields: []string{"method", "googlekey", "pageurl", "action"}}
)

var goldenKeys = []struct {
	name        string
	method, url string
	header      http.Header
	user, body  string
	spec        *KeySpec
	want        string
}{
	// Method and URL.
	{name: "plain get", method: "GET", url: "https://example.com/", want: "v1:94ac51234de0f591324841da6e88608be0e13362fdb24268ef7f9464f59bbf39"},
	{name: "empty method", method: "", url: "https://example.com/", want: "v1:94ac51234de0f591324841da6e88608be0e13362fdb24268ef7f9464f59bbf39"},
	{name: "head", method: "HEAD", url: "https://example.com/", want: "v1:682a12ccd015ed1363f1c731d27e32dbd8cb7e0372072bfa0b20b4f91dfa7daf"},
	{name: "lower-case method", method: "get", url: "https://example.com/", want: "v1:8189500674a819c11bb1be49cca0de98c9622580d67b6ff63920d9d1d62634aa"},
	{name: "http", method: "GET", url: "http://example.com/", want: "v1:caebfb7d41dbc7085d573be8fc67c2c2f64683ef229d43c0d084b237ba56af5c"},
	{name: "url normalized", method: "GET", url: "HTTPS://Example.COM:443/a/./b/../c?b=2&a=1&utm_source=x#frag", want: "v1:30d73ac0c9f1ab0c18b1fdb99a2d92d9dffb7a501b5605ed3f0b95fef8d20b46"},
	{name: "url escapes", method: "GET", url: "https://e.com/%7euser/a%2fb/caf%c3%a9?q=a+b&r=%zz&r=a%20b", want: "v1:ef75408087693a0264b1c1b9522dfc4cd3bedc4b5fa72da27df4824f2bbebc4b"},
	{name: "url idna", method: "GET", url: "http://Bücher.example.:8080/", want: "v1:c41f4835776bfb7e240c25a121f0f8bf2fce302309e01b26ae3e467b5e2c976f"},
	{name: "url ipv6 zone", method: "GET", url: "http://[fe80::1%25eth0]:8080/x", want: "v1:a809f0e8ea71fb8764a89535cb70d72397544df0fc05fa8ded3fc5ffc5aa10a3"},
	{name: "url repeated params", method: "GET", url: "https://e.com/p?a=2&b=0&a=1&a&a=", want: "v1:e3a6c4c215e2eea3baa5109683708fbdf4da404aab56a08a077646d6c78827a3"},
	{name: "url userinfo", method: "GET", url: "https://alice:pw@e.com/", want: "v1:9c3a79b4ae5ac9e806a82adba10c7c40f4e0feca280708eaadf6b14205eafe4e"},
	{name: "url user only", method: "GET", url: "https://alice@e.com/", want: "v1:75b01fdc56411ecef14e681e338809c501f9f4acd6effd7092f123904c053a01"},

	// Keyed headers.
	{name: "accept", method: "GET", url: "https://e.com/", header: http.Header{"Accept": {"text/html"}}, want: "v1:d650a7f03a847f8da44c71c8a9289e16bb085c2e4605e5a3e09cd80a0944cd3e"},
	{name: "accept empty", method: "GET", url: "https://e.com/", header: http.Header{"Accept": {""}}, want: "v1:a61bf00b40a0525b997b91200cd43b609eb8abca24da6f2fd090cda72d812e2d"},
	{name: "accept lines and OWS", method: "GET", url: "https://e.com/", header: http.Header{"Accept": {" a\t", "b"}, "Accept-Language": {"en-US,en;q=0.9"}}, want: "v1:2bbc3c14a956bf1f9bdfc712955a7f2e1691529fa88a11146d06eef20d720f22"},
	{name: "unkeyed headers", method: "GET", url: "https://e.com/", header: http.Header{"Accept-Encoding": {"gzip"}, "User-Agent": {"x"}}, want: "v1:71a64edfb3369bdfd86e65f9f4a7378027f1fa3a9535e18231ae66a5b7f9cb23"},
	{name: "custom headers", method: "GET", url: "https://e.com/", header: http.Header{"Accept": {"a"}, "X-Api-Version": {"2"}}, spec: &KeySpec{Headers: []string{"x-api-version", "Accept-Encoding", " accept "}}, want: "v1:61a6e2efa5296ad39645cb413d420f0cee59290435f81a56b96118e9d64df4c8"},
	{name: "no headers", method: "GET", url: "https://e.com/", header: http.Header{"Accept": {"a"}}, spec: &KeySpec{Headers: []string{}}, want: "v1:e579d08cb0445cd507325f78534fc550a5faf19b7de7f9eaa797fc701283fedd"},
	{name: "conditional headers", method: "GET", url: "https://e.com/", header: http.Header{
		"Range": {"bytes=0-99"}, "If-Range": {`"e"`}, "If-Match": {`"m"`}, "If-None-Match": {`"n"`},
		"If-Modified-Since": {"Mon, 02 Jan 2006 15:04:05 GMT"}, "If-Unmodified-Since": {"Tue, 03 Jan 2006 15:04:05 GMT"},
	}, want: "v1:441d4120e6b5726ffed13b3114534de5acb25487d4bd6832bdce3b15a4410e40"},

	// Credentials.
	{name: "authorization", method: "GET", url: "https://e.com/", header: http.Header{"Authorization": {"Bearer a", " Basic b "}}, want: "v1:bd0c50113b8c17ea9e5ab93869b2d4d2a9bd9ecae1e9553ae9713a539a8d575a"},
	{name: "cookies", method: "GET", url: "https://e.com/", header: http.Header{"Cookie": {"b=2; a=1;; c", "a=0"}}, want: "v1:606e2fa174fea6711ac42b3bfd8d8eb3fd08483c9927fefe2c97f547c9c5024b"},
	{name: "proxy user", method: "GET", url: "https://e.com/", user: "alice", want: "v1:d90d2ac68e9c1a9d5b621a79283a85caa0383762620601b9e385ae54f5afb74b"},
	{name: "all credentials", method: "GET", url: "https://u:p@e.com/", header: http.Header{"Authorization": {"x"}, "Cookie": {"s=1"}}, user: "bob", want: "v1:9f6d6a4bdab8ab836e5d24c8dd041b485c9fe6416b58cba9906d5fd2331aa9fe"},
	{name: "shared credentials", method: "GET", url: "https://u:p@e.com/", header: http.Header{"Authorization": {"x"}, "Cookie": {"s=1"}}, user: "bob", spec: &KeySpec{ShareCredentials: true}, want: "v1:51f537279b5a096cf646a319e7d4564cd04e443d3159361c330b3b0c209d206d"},
	{name: "custom ignore params", method: "GET", url: "https://e.com/?utm_source=x&sess_id=1&a=1", spec: &KeySpec{IgnoreParams: []string{"sess_*"}}, want: "v1:0404c2e486be15c7358c097cddc9cddbef74e2ed598d201d7b42f72b8601be44"},
	{name: "ignore nothing", method: "GET", url: "https://e.com/?utm_source=x", spec: &KeySpec{IgnoreParams: []string{}}, want: "v1:5859e5b17672c1f385ed53234e210650ca4c8bb4b4d10443d9937162f4e7c9c8"},

	// Bodies.
	{name: "body not keyed", method: "POST", url: "https://e.com/in", body: "a=1", want: "v1:a2e19929f048841a624a8059d1619e6b76c4d42fed7e16a9d51a9b5e49e26028"},
	{name: "body hashed", method: "POST", url: "https://e.com/in", body: "a=1", spec: &KeySpec{Body: true}, want: "v1:76e2951679be83ed55cc684484530a87a58badbe60d72af7d674da7aa9521360"},
	{name: "body empty", method: "POST", url: "https://e.com/in", spec: &KeySpec{Body: true}, want: "v1:8cc547d002bc301018f080e6d1e43ddb36847e0c09328ad75115126d06f8ccd2"},
	{name: "body typed and encoded", method: "POST", url: "https://e.com/in", header: http.Header{"Content-Type": {"text/plain"}, "Content-Encoding": {"gzip"}}, body: "\x1f\x8b", spec: &KeySpec{Body: true}, want: "v1:f36e94579d09d214de52e5fec7bc9878bb05bd48d62f30c5c4f86a06a79e4b92"},
	{name: "form fields", method: "POST", url: "https://e.com/in.php", header: goldenForm, body: "key=S&pageurl=P&method=userrecaptcha&googlekey=K&method=b+c", spec: goldenCaptcha, want: "v1:4ddab40b5c0ea44ea8f2ba3b036dec0f104282179c9b3e57028eb49d1bd69620"},
	{name: "form without fields", method: "POST", url: "https://e.com/in.php", header: goldenForm, body: "key=S", spec: goldenCaptcha, want: "v1:71f557b5919a0aed9e1d2fddc708883161c623415671fb436ee3f697ea281234"},
	{name: "form unparseable", method: "POST", url: "https://e.com/in.php", header: goldenForm, body: "method=x&key=%zz", spec: goldenCaptcha, want: "v1:93182cf1f566a1e965f8cfcf98e03ee73bf89213d9ec0e21632682caf4038b91"},
	{name: "json fields", method: "POST", url: "https://e.com/api", header: goldenJSON, body: ` {"key":"S", "action":{"b":[1, {"d":2,"c":"\u0041"}],"a":null},"m\u0065thod":1.0} `, spec: goldenCaptcha, want: "v1:d208edb046d54d244e46686ee12c55e03ff2851de2e29d235435932eeebd5345"},
	{name: "json +json type", method: "POST", url: "https://e.com/api", header: http.Header{"Content-Type": {"application/vnd.api+json; charset=utf-8"}}, body: `{"method":"a","pageurl":"\ud83d\ude00"}`, spec: goldenCaptcha, want: "v1:ba37d6900001977058fb77de0177a7b9d5bf56f636642061cf1450f657e6c010"},
	{name: "json duplicate name", method: "POST", url: "https://e.com/api", header: goldenJSON, body: `{"method":"a","method":"b"}`, spec: goldenCaptcha, want: "v1:41e80493ffbe09decffc225b12b6fdc49f0cff76113ec5ab65cc2d7153179476"},
	{name: "json too deep", method: "POST", url: "https://e.com/api", header: goldenJSON, body: `{"action":` + strings.Repeat("[", 70) + strings.Repeat("]", 70) + `}`, spec: goldenCaptcha, want: "v1:1c03fc0942fd8c9d25b3c7fffc120f53bff9ceeb65d16ce49aa42a1b4f80c5a7"},
	{name: "json not an object", method: "POST", url: "https://e.com/api", header: goldenJSON, body: `["method"]`, spec: goldenCaptcha, want: "v1:c24f6a6f413c7cfc16d5222c1aae43032da86cb405629205d1cf31c65e7adc68"},
	{name: "json with content-encoding", method: "POST", url: "https://e.com/api", header: http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {"identity"}}, body: `{"method":"a"}`, spec: goldenCaptcha, want: "v1:81ab2618bc617ca1475abc36ad98737bd8f0dd164e937ad5ac2d43c1585b10aa"},
	{name: "fields without body", method: "POST", url: "https://e.com/api", header: goldenJSON, body: `{"method":"a"}`, spec: &KeySpec{BodyFields: []string{"method"}}, want: "v1:b14c3e5d31c939e5f03393251c092878263def010a443f6633c5783487bd2758"},
}

func TestKeyGolden(t *testing.T) {
	for _, tt := range goldenKeys {
		t.Run(tt.name, func(t *testing.T) {
			var body []byte
			if tt.body != "" {
				body = []byte(tt.body)
			}
			got, err := NewKeyer(tt.spec).Key(tt.method, mustParse(t, tt.url), tt.header, Requester{Account: tt.user}, body)
			if err != nil {
				t.Fatalf("Key: %v", err)
			}
			if got != tt.want {
				t.Errorf("Key = %s, want %s", got, tt.want)
			}
		})
	}
}

var goldenURLKeys = []struct {
	url  string
	spec *KeySpec
	want string
}{
	{url: "https://example.com/", want: "u1:0f115db062b7c0dd030b16878c99dea5c354b49dc37b38eb8846179c7783e9d7"},
	{url: "HTTPS://Example.COM:443/p?b=1&a=2&utm_source=x#f", want: "u1:88ca497ba6e3e7d729b1a5dc653c76bcbbccc35dce3618e0d3dff3742b6f7333"},
	{url: "http://u:p@[2001:DB8::1]:8080/a%2fb?q", want: "u1:23fc9c6f106b7181d1da530688a75eb9dd950dbb054091a477f6bd3d7f00b160"},
	{url: "https://e.com/?utm_source=x&a=1", spec: &KeySpec{IgnoreParams: []string{}}, want: "u1:c48c907cd848137c326ce0405e6926446e671b2250bd67ffcead8dc306f66740"},
}

func TestURLKeyGolden(t *testing.T) {
	for _, tt := range goldenURLKeys {
		got, err := NewKeyer(tt.spec).URLKey(mustParse(t, tt.url))
		if err != nil {
			t.Fatalf("URLKey(%q): %v", tt.url, err)
		}
		if got != tt.want {
			t.Errorf("URLKey(%q) = %s, want %s", tt.url, got, tt.want)
		}
	}
}

func TestVariantKeyGolden(t *testing.T) {
	const key = "v1:82b42dd23e7f8844189066dd0098bdee222a9895ae91df5054be3bdb75ff320c"
	tests := []struct {
		name   string
		vary   []HeaderValue
		header http.Header
		want   string
	}{
		{name: "no vary", want: "v1:e55090a1b4667bf1c5c1458f02ff6145c7d5733ef617c412c5d25e6e5db224fa"},
		{name: "absent header", vary: []HeaderValue{{Name: "X-Mode"}}, want: "v1:8708d586c22510abdd65002c55501f90cd323cf79f9eefcf14f3a0c0ddc5ed5b"},
		{name: "values joined", vary: []HeaderValue{{Name: "Accept"}, {Name: "X-Mode"}}, header: http.Header{"Accept": {" a ", "b"}, "X-Mode": {"dark"}}, want: "v1:92f78fd00ff44399f02739832d59c9d5cfea9e7236e988f70393e4d2f77965de"},
	}
	for _, tt := range tests {
		if got := variantKey(key, tt.vary, tt.header); got != tt.want {
			t.Errorf("%s: variantKey = %s, want %s", tt.name, got, tt.want)
		}
	}
}
