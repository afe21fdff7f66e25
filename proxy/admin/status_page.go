package admin

import (
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"html/template"
	"net/http"
	"strconv"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// statusData is what the status page renders.
type statusData struct {
	Now   time.Time
	Stats dedup.Stats
	// FleetStore names the store the fleet shares ("" when this instance
	// runs alone); FleetAvailable says whether it is in use now.
	FleetStore     string
	FleetAvailable bool
	Sessions       []upstream.SessionStatus
	// Providers with their sessions, highest priority first.
	Providers []providerRows
	Egress    string
	CAPEM     string
	SPKI      string // base64 SHA-256 of the CA's public key, for Chromium
	Cache     bool
	Proxy     string // the proxy port's address, for the recipes
	// Clients are the most frequent fingerprints of recent client
	// connections; ShowClients is false without a source.
	Clients     []fingerprint.Seen
	ShowClients bool
}

// providerRows is one provider and its sessions on the status page.
type providerRows struct {
	upstream.ProviderStatus
	Rows []upstream.SessionStatus
}

// byProvider groups sessions under their providers; a provider without
// sessions still shows (why it has none is the point).
func byProvider(providers []upstream.ProviderStatus, sessions []upstream.SessionStatus) []providerRows {
	out := make([]providerRows, 0, len(providers))
	for _, ps := range providers {
		rows := providerRows{ProviderStatus: ps}
		for _, s := range sessions {
			if s.Provider == ps.Name {
				rows.Rows = append(rows.Rows, s)
			}
		}
		if ps.API == "" && len(rows.Rows) == 0 {
			continue // no hand-listed sessions: nothing to show
		}
		out = append(out, rows)
	}
	return out
}

// spkiHash is what Chromium's --ignore-certificate-errors-spki-list wants:
// base64(sha256(SubjectPublicKeyInfo)) of the CA.
func spkiHash(caPEM []byte) string {
	block, _ := pem.Decode(caPEM)
	if block == nil {
		return ""
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return ""
	}
	sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
	return base64.StdEncoding.EncodeToString(sum[:])
}

// statusPage serves GET /: what onceproxy is doing now, for people.
func statusPage(o Options) http.HandlerFunc {
	spki := spkiHash(o.CAPEM)
	return func(w http.ResponseWriter, r *http.Request) {
		d := statusData{Now: time.Now().UTC(), CAPEM: string(o.CAPEM), SPKI: spki, Cache: o.Cache != nil, Proxy: o.ProxyAddr}
		if d.Proxy == "" {
			d.Proxy = "127.0.0.1:8080"
		}
		if o.Cache != nil {
			d.Stats = o.Cache.Stats()
		}
		if o.Fleet != nil {
			// What the instance knows of the store, not a read of the
			// fleet's statistics from it: the page named the store only
			// when that read worked, so a store down was a store unsaid,
			// and each refresh of an open page was a round trip to it.
			d.FleetStore, d.FleetAvailable = o.Fleet.Name(), o.Fleet.Available()
		}
		if o.Sessions != nil {
			d.Sessions, d.Egress = o.Sessions.Sessions(), o.Sessions.Describe()
			d.Providers = byProvider(o.Sessions.Providers(), d.Sessions)
		}
		if o.Fingerprints != nil {
			d.Clients, d.ShowClients = o.Fingerprints.ClientFingerprints(), true
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
		if err := statusTmpl.Execute(w, d); err != nil {
			http.Error(w, "status page: "+err.Error(), http.StatusInternalServerError)
		}
	}
}

var statusTmpl = template.Must(template.New("status").Funcs(template.FuncMap{
	"money": func(v float64) string { return strconv.FormatFloat(v, 'f', moneyDigits(v), 64) },
	"bytes": func(n any) string {
		var v float64
		switch x := n.(type) {
		case uint64:
			v = float64(x)
		case int64:
			v = float64(x)
		}
		units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
		i := 0
		for v >= 1024 && i < len(units)-1 {
			v /= 1024
			i++
		}
		return formatFloat(v) + " " + units[i]
	},
}).Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="5">
<title>onceproxy</title>
<style>
body{font:15px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:62rem;padding:0 1rem;color:#1d232a}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}h3{font-size:1rem;margin:1.2rem 0 .4rem}
.sub{color:#666}.big{font-size:2.4rem;font-weight:700}.cards{display:flex;gap:1rem;flex-wrap:wrap}
.card{border:1px solid #ddd;border-radius:6px;padding:.7rem 1rem;min-width:9rem}
.card b{display:block;font-size:1.4rem}table{border-collapse:collapse;width:100%}
td,th{text-align:left;padding:.25rem .6rem;border-bottom:1px solid #eee;font-variant-numeric:tabular-nums}
.ok{color:#17803d}.bad{color:#b42318}code,pre{background:#f5f5f5;border-radius:4px;padding:.1rem .3rem}
pre{padding:.6rem;overflow-x:auto;white-space:pre-wrap;word-break:break-all}
</style></head><body>
<h1>onceproxy</h1>
<div class="sub">A deduplicating forward proxy: every logical request goes upstream once. {{.Now.Format "2006-01-02 15:04:05 UTC"}}, refreshes every 5 s.</div>
{{if .Cache}}{{with .Stats}}
<h2>Savings (this instance)</h2>
<div class="cards">
<div class="card"><span>savings</span><b id="savings">{{.SavingsPct}}%</b></div>
<div class="card"><span>money saved</span><b id="money">{{money .MoneySaved}} {{.Currency}}</b></div>
<div class="card"><span>requests</span><b id="requests">{{.Requests}}</b></div>
<div class="card"><span>HIT</span><b id="hit">{{index .XCache "HIT"}}</b></div>
<div class="card"><span>COALESCED</span><b id="coalesced">{{index .XCache "COALESCED"}}</b></div>
<div class="card"><span>MISS</span><b id="miss">{{index .XCache "MISS"}}</b></div>
<div class="card"><span>BYPASS</span><b id="bypass">{{index .XCache "BYPASS"}}</b></div>
</div>
<p>Upstream requests: <b id="upstream">{{.UpstreamRequests}}</b> · avoided: <b>{{.RequestsAvoided}}</b> ({{bytes .BytesAvoided}} not downloaded again)
· flights running: {{.Flights}}{{if .Sharing}} ({{.Sharing}} handing their answer to the fleet's store){{end}}, clients waiting on them: {{.Waiters}}
· cache: {{.Store.Entries}} responses, {{bytes .Store.Bytes}} of {{bytes .Store.MaxBytes}} ({{.Store.Kind}})</p>
{{end}}{{end}}
{{with .FleetStore}}<p id="store">Shared store: {{.}}, {{if $.FleetAvailable}}<span class="ok">in use</span>{{else}}<span class="bad">unavailable</span> (not used until it answers again){{end}}. Fleet-wide statistics (all instances sharing it) are at <a href="/cache/stats">/cache/stats</a>.</p>{{end}}
<h2>Upstream sessions</h2>
{{if .Sessions}}{{range .Providers}}
<h3 id="provider-{{.Name}}">{{.Name}} <span class="sub">priority {{.Priority}}{{with .API}} · {{.}}{{end}}{{with .Countries}} · countries {{range $i, $c := .}}{{if $i}}, {{end}}{{$c}}{{end}}{{end}}</span>
{{if .Available}}<span class="ok">serving</span>{{else}}<span class="bad">unavailable: {{.Reason}}</span>{{end}}
<span class="sub">· {{.Ready}}/{{.Sessions}} ready · failovers {{.Failovers}} · failbacks {{.Failbacks}}{{with .Refresh}}{{if .LastError}} · API: {{.LastError}}{{with .NextTryIn}} (next try in {{.}}){{end}}{{end}}{{end}}</span></h3>
{{if .Rows}}<table><tr><th>session</th><th>gateway</th><th>country</th><th>rotation</th><th>exit IP</th><th>weight</th><th>state</th><th>requests</th><th>failures</th><th>rotations</th><th>last</th></tr>
{{range .Rows}}<tr><td>{{.ID}}</td><td><code>{{.Proxy}}</code></td><td>{{.Country}}{{with .City}} {{.}}{{end}}</td><td>{{.Rotation}}</td><td>{{.ExitIP}}</td><td>{{.Weight}}/{{.BaseWeight}}</td>
<td>{{if .Available}}<span class="ok">ready</span>{{else}}<span class="bad">cooling {{.CooldownRemaining}}</span>{{end}}</td>
<td>{{.Requests}}</td><td>{{.Failures}}</td><td>{{.Rotations}}</td><td>{{.LastOutcome}}</td></tr>
{{end}}</table>{{end}}{{end}}{{else}}{{if .Providers}}{{range .Providers}}<p>Provider <b>{{.Name}}</b>: no sessions{{if not .Available}} ({{.Reason}}){{end}}{{with .Refresh}}{{if .LastError}}; its API: {{.LastError}}{{with .NextTryIn}} (next try in {{.}}){{end}}{{end}}{{end}}.</p>{{end}}{{else}}<p>No upstream sessions: requests leave directly{{with .Egress}} ({{.}}){{end}}.</p>{{end}}{{end}}
{{if .ShowClients}}<h2>Client fingerprints</h2>
<p>What the origins see of the intercepted clients (each connection opens its origin connections with its client's TLS hello and HTTP/2 settings): the most frequent recent TLS fingerprints. A JA4 names a TLS stack, not a person.</p>
{{if .Clients}}<table id="fingerprints"><tr><th>JA4</th><th>HTTP</th><th>HTTP/2 (Akamai)</th><th>connections</th><th>last seen</th></tr>
{{range .Clients}}<tr><td><code>{{.JA4}}</code></td><td>{{.HTTP}}</td><td><code>{{.Akamai}}</code></td><td>{{.Count}}</td><td>{{.Last.UTC.Format "15:04:05"}}</td></tr>
{{end}}</table>{{else}}<p>No intercepted TLS client yet.</p>{{end}}{{end}}
<h2>Trust the CA</h2>
<p>Download <a href="/ca.pem">ca.pem</a> and trust it in every client (never share <code>ca-key.pem</code>):</p>
<pre>curl -x http://{{.Proxy}} --cacert ca.pem https://example.com/
REQUESTS_CA_BUNDLE=$PWD/ca.pem HTTPS_PROXY=http://{{.Proxy}} python3 your_scraper.py
chromium --proxy-server=http://{{.Proxy}} --ignore-certificate-errors-spki-list={{.SPKI}} --user-data-dir=$(mktemp -d)</pre>
<p>The SPKI hash of this CA, for Chromium and Playwright: <code id="spki">{{.SPKI}}</code></p>
<p>API: <a href="/cache/stats">/cache/stats</a> · <a href="/upstream/sessions">/upstream/sessions</a> · <a href="/metrics">/metrics</a> · <a href="/health">/health</a></p>
</body></html>
`))

// moneyDigits shows cents for sums of a currency unit or more, and enough
// digits to see small savings (a few HITs at a fraction of a cent each).
func moneyDigits(v float64) int {
	if v >= 1 || v == 0 {
		return 2
	}
	return 6
}

func formatFloat(v float64) string {
	if v == float64(int64(v)) {
		return strconv.FormatInt(int64(v), 10)
	}
	return strconv.FormatFloat(v, 'f', 1, 64)
}
