package app

import (
	"bytes"
	"cmp"
	"encoding"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/listenaddr"
	"github.com/seed-a3c387e8/onceproxy/internal/loglimit"
	"github.com/seed-a3c387e8/onceproxy/internal/logtext"
	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/auth"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/pgstore"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/rediscache"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// envPrefix starts every environment override: ONCEPROXY_PROXY_LISTEN sets
// proxy.listen. The value is YAML, parsed exactly like the file.
const envPrefix = "ONCEPROXY_"

// Config is the whole configuration, one section per package.
type Config struct {
	Log       LogConfig           `yaml:"log"`
	Proxy     proxy.Config        `yaml:"proxy"`
	SOCKS5    socks.Config        `yaml:"socks5"`
	Admin     AdminConfig         `yaml:"admin"`
	MITM      mitm.Config         `yaml:"mitm"`
	Upstream  upstream.Config     `yaml:"upstream"`
	Dedup     dedup.Config        `yaml:"dedup"`
	Redis     rediscache.Config   `yaml:"redis"`
	Postgres  pgstore.Config      `yaml:"postgres"`
	Fleet     FleetConfig         `yaml:"fleet"`
	Auth      auth.Config         `yaml:"auth"`
	RateLimit ratelimit.Config    `yaml:"rate_limit"`
	Guard     netguard.Config     `yaml:"guard"`
	Savings   dedup.SavingsConfig `yaml:"savings"`
	Process   ProcessConfig       `yaml:"process"`
}

// LogConfig is the `log:` section.
type LogConfig struct {
	// Level is debug, info, warn or error.
	Level string `yaml:"level"`
	// Format is text or json.
	Format string `yaml:"format"`
	// Access logs one line per request and per tunnel.
	Access bool `yaml:"access"`
}

// AdminConfig is the `admin:` section.
type AdminConfig struct {
	// Listen is the admin API address; "" turns the admin API off.
	Listen string `yaml:"listen"`
	// TokenEnv names an environment variable holding a bearer token that
	// every admin endpoint but /health and /ca.pem then requires. Without
	// one, Listen must be a loopback address unless
	// auth.allow_unauthenticated is set.
	TokenEnv string `yaml:"token_env"`
	// Pprof serves net/http/pprof under /debug/pprof/ on the admin port
	// (never on the proxy port).
	Pprof bool `yaml:"pprof"`
}

// LoadConfig reads the configuration: shipped (config.yaml as shipped: the
// defaults every run starts from, so the file users read and the defaults
// the binary uses are the same text), then the file at path (skipped when
// path is ""), then ONCEPROXY_* variables from environ. Every problem is
// reported at once, each with its key: unknown keys and values of the
// wrong type (the file's first, in line order, then the variables'), then
// the checks of what was read, which run on everything that decoded. A
// key whose value was refused is not checked again. Only a file that is
// not YAML, or whose decoding stopped short, ends loading before the
// checks (a half-read file would fail them for keys it does set).
func LoadConfig(shipped []byte, path string, environ []string) (*Config, error) {
	getenv := func(k string) string { return LookupEnv(environ, k) }
	var cfg Config
	if err := decodeStrict(bytes.NewReader(shipped), &cfg); err != nil {
		return nil, fmt.Errorf("embedded config.yaml: %w", err)
	}
	base := cfg
	var fileErrs []error
	var written []writtenDoc // what the file and the variables say, as YAML
	if path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("config: %w", err)
		}
		written = append(written, writtenDoc{doc: b})
		if err := decodeStrict(bytes.NewReader(b), &cfg); err != nil {
			var ce *configError
			if !errors.As(err, &ce) || ce.incomplete {
				return nil, fmt.Errorf("config %s: %w", path, err)
			}
			fileErrs = ce.errs
		}
	}
	errs := slices.Clone(fileErrs)
	errs = append(errs, flatten(applyEnv(&cfg, environ))...)
	errs = append(errs, flatten(conventionalStore(&cfg, environ))...)
	refused := refusedKeys(errs)
	later := explicitZeros(&base, &cfg, environ)
	cfg.withDefaults()
	later = append(later, listZeros(&cfg, append(written, envDocs(&cfg, environ)...))...)
	slices.SortFunc(later, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) })
	later = append(later, flatten(cfg.validate(getenv))...)
	for _, err := range later {
		if !refused(err) {
			errs = append(errs, err)
		}
	}
	switch {
	case len(errs) == 0:
		return &cfg, nil
	case len(fileErrs) > 0:
		// The lines the file's problems name are the file's.
		return nil, fmt.Errorf("config %s: %w", path, &configError{errs: errs})
	}
	return nil, &configError{errs: errs}
}

// keyError is a problem with the value of one key, found while decoding:
// the value the key holds is then not what was written (the one before
// it, or 2 for 2.9), and the checks that follow say nothing of it.
type keyError struct {
	key string // yaml path, "upstream.retry.max_attempts"
	err error
}

func (e *keyError) Error() string { return e.err.Error() }
func (e *keyError) Unwrap() error { return e.err }

// refusedKeys returns what tells whether a later problem is about a key
// one of errs refused, its message starting with the key's path.
func refusedKeys(errs []error) func(error) bool {
	var keys []string
	for _, err := range errs {
		var ke *keyError
		if errors.As(err, &ke) && ke.key != "" {
			keys = append(keys, ke.key)
		}
	}
	return func(err error) bool {
		msg := err.Error()
		for _, k := range keys {
			if rest, ok := strings.CutPrefix(msg, k); ok && (strings.HasPrefix(rest, ":") || strings.HasPrefix(rest, "[")) {
				return true
			}
		}
		return false
	}
}

// zeroMeans are the keys config.yaml ships with a value other than 0 and
// gives 0 a meaning of its own.
var zeroMeans = map[string]bool{"dedup.ttl": true, "dedup.disk.max_bytes": true}

// explicitZeros reports every number set to 0 where 0 means nothing: the
// sections take 0 for "unset" and fill in their default, and a key
// config.yaml ships non-zero can only be 0 because the file or a variable
// said so (proxy.idle_timeout: 0s for no timeout ran with 2m). An empty
// variable clears its key back to the default, as documented.
func explicitZeros(shipped, cfg *Config, environ []string) []error {
	running := envKeys(cfg)
	var errs []error
	for name, k := range envKeys(shipped) {
		switch k.field.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64, reflect.Float32, reflect.Float64:
		default:
			continue
		}
		if k.field.IsZero() || zeroMeans[k.path] || !running[name].field.IsZero() {
			continue
		}
		if v, set := lookupEnvSet(environ, name); set && v == "" {
			continue
		}
		errs = append(errs, fmt.Errorf("%s: 0 has no meaning here; remove the key for its default (%v)", k.path, k.field.Interface()))
	}
	slices.SortFunc(errs, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) })
	return errs
}

// writtenDoc is YAML that set keys: the file (at the top, key ""), or a
// variable's value (at its key).
type writtenDoc struct {
	key string
	doc []byte
}

// envDocs returns the values of the variables that set a list of
// sections (upstream.sessions, dedup.rules) and were taken.
func envDocs(cfg *Config, environ []string) []writtenDoc {
	keys := envKeys(cfg)
	var docs []writtenDoc
	for _, kv := range environ {
		name, val, _ := strings.Cut(kv, "=")
		k, ok := keys[name]
		if !ok || val == "" || k.field.Kind() != reflect.Slice || !isSection(k.field.Type().Elem()) {
			continue
		}
		if decodeStrict(strings.NewReader(val), reflect.New(k.field.Type()).Interface()) == nil {
			docs = append(docs, writtenDoc{key: k.path, doc: []byte(val)})
		}
	}
	return docs
}

// listZeros is explicitZeros for the entries of lists (a session's
// weight, a provider's timeout): nothing ships in them to compare with,
// so it looks at what was written. A number written 0 there that the
// section's defaults replaced (cfg has them) had no meaning; one they
// keep (a provider's priority) did. A list a variable set is read from
// the variable, not the file.
func listZeros(cfg *Config, written []writtenDoc) []error {
	shadowed := map[string]bool{}
	for _, w := range written {
		if w.key != "" {
			shadowed[w.key] = true
		}
	}
	var errs []error
	var walk func(n *yaml.Node, v reflect.Value, path string, inList bool)
	walk = func(n *yaml.Node, v reflect.Value, path string, inList bool) {
		if n.Kind == yaml.AliasNode && n.Alias != nil {
			n = n.Alias
		}
		switch n.Kind {
		case yaml.DocumentNode:
			for _, c := range n.Content {
				walk(c, v, path, inList)
			}
		case yaml.MappingNode:
			if v.Kind() != reflect.Struct || !isSection(v.Type()) {
				return
			}
			for i := 0; i+1 < len(n.Content); i += 2 {
				k, c := n.Content[i], n.Content[i+1]
				p := strings.TrimPrefix(path+"."+k.Value, ".")
				if !inList && shadowed[p] {
					continue // a variable's value is the one in force
				}
				for j := range v.NumField() {
					if yamlName(v.Type().Field(j)) == k.Value {
						walk(c, v.Field(j), p, inList)
					}
				}
			}
		case yaml.SequenceNode:
			if v.Kind() != reflect.Slice {
				return
			}
			for i, c := range n.Content {
				if i < v.Len() {
					walk(c, v.Index(i), fmt.Sprintf("%s[%d]", path, i), true)
				}
			}
		case yaml.ScalarNode:
			switch v.Kind() {
			case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64, reflect.Float32, reflect.Float64:
			default:
				return
			}
			if !inList || n.ShortTag() == "!!null" || v.IsZero() {
				return
			}
			// What was written, read as the key reads it.
			w := reflect.New(v.Type())
			if n.Decode(w.Interface()) != nil || !w.Elem().IsZero() {
				return
			}
			errs = append(errs, fmt.Errorf("%s: 0 has no meaning here; remove the key for its default (%v)", path, v.Interface()))
		}
	}
	root := reflect.ValueOf(cfg).Elem()
	for _, w := range written {
		var doc yaml.Node
		if yaml.Unmarshal(w.doc, &doc) != nil {
			continue
		}
		v, path := root, ""
		if w.key != "" {
			v, path = keyField(root, w.key), w.key
		}
		if v.IsValid() {
			walk(&doc, v, path, false)
		}
	}
	return errs
}

// keyField is the field of the Config v that the key path key names.
func keyField(v reflect.Value, key string) reflect.Value {
	for name := range strings.SplitSeq(key, ".") {
		found := reflect.Value{}
		for j := range v.NumField() {
			if yamlName(v.Type().Field(j)) == name {
				found = v.Field(j)
			}
		}
		if !found.IsValid() {
			return found
		}
		v = found
	}
	return v
}

// lookupEnvSet returns the value of name in environ and whether it is set.
func lookupEnvSet(environ []string, name string) (string, bool) {
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok && k == name {
			return v, true
		}
	}
	return "", false
}

// conventionalStore fills the shared store from the variables platforms
// inject, REDIS_URL and DATABASE_URL, when the configuration names none:
// a store configured explicitly (file or ONCEPROXY_*) wins over them.
func conventionalStore(cfg *Config, environ []string) error {
	if cfg.Redis.Enabled() || cfg.Postgres.Enabled() {
		return nil
	}
	redisURL, databaseURL := LookupEnv(environ, "REDIS_URL"), LookupEnv(environ, "DATABASE_URL")
	switch {
	case redisURL != "" && databaseURL != "":
		return &configError{errs: []error{errors.New("REDIS_URL and DATABASE_URL are both set: a fleet shares one store; choose it with redis.url or postgres.url (ONCEPROXY_REDIS_URL, ONCEPROXY_POSTGRES_URL)")}}
	case redisURL != "":
		cfg.Redis.URL = redisURL
	case databaseURL != "":
		cfg.Postgres.URL = databaseURL
	}
	return nil
}

func (c *Config) withDefaults() {
	c.Proxy = c.Proxy.WithDefaults()
	c.SOCKS5 = c.SOCKS5.WithDefaults()
	c.MITM = c.MITM.WithDefaults()
	c.Upstream = c.Upstream.WithDefaults()
	c.Dedup = c.Dedup.WithDefaults()
	c.Redis = c.Redis.WithDefaults()
	c.Postgres = c.Postgres.WithDefaults()
	c.Fleet = c.Fleet.WithDefaults()
	c.Auth = c.Auth.WithDefaults()
	c.RateLimit = c.RateLimit.WithDefaults()
	c.Savings = c.Savings.WithDefaults()
}

// validate checks every section and returns all problems, one per line, each
// prefixed with the full key path ("proxy.listen: ...").
func (c *Config) validate(getenv func(string) string) error {
	var errs []error
	add := func(section string, err error) {
		for _, e := range flatten(err) {
			errs = append(errs, fmt.Errorf("%s.%w", section, e))
		}
	}
	switch strings.ToLower(c.Log.Level) {
	case "debug", "info", "warn", "error":
	default:
		errs = append(errs, fmt.Errorf("log.level: must be debug, info, warn or error, got %q", c.Log.Level))
	}
	switch c.Log.Format {
	case "text", "json":
	default:
		errs = append(errs, fmt.Errorf("log.format: must be text or json, got %q", c.Log.Format))
	}
	if c.Admin.Listen != "" {
		if err := listenaddr.Check(c.Admin.Listen); err != nil {
			errs = append(errs, fmt.Errorf("admin.listen: %w", err))
		} else if c.Admin.Listen == c.Proxy.Listen && !strings.HasSuffix(c.Admin.Listen, ":0") {
			errs = append(errs, fmt.Errorf("admin.listen: must differ from proxy.listen (%s)", c.Proxy.Listen))
		}
	}
	add("proxy", c.Proxy.Validate())
	add("socks5", c.SOCKS5.Validate())
	if l := c.SOCKS5.Listen; l != "" && !strings.HasSuffix(l, ":0") && (l == c.Proxy.Listen || l == c.Admin.Listen) {
		errs = append(errs, fmt.Errorf("socks5.listen: %s is already proxy.listen or admin.listen", l))
	}
	add("mitm", c.MITM.Validate())
	add("upstream", c.Upstream.Validate(getenv))
	add("dedup", c.Dedup.Validate())
	add("redis", c.Redis.Validate())
	add("postgres", c.Postgres.Validate())
	if c.Redis.Enabled() && c.Postgres.Enabled() {
		redisKey := "redis.url"
		if c.Redis.URL == "" {
			redisKey = "redis.addrs"
		}
		errs = append(errs, fmt.Errorf("postgres.url: set together with %s: a fleet shares one store, Redis or PostgreSQL; configure one of them", redisKey))
	}
	errs = append(errs, c.validateFleet(getenv)...)
	add("auth", c.Auth.Validate(getenv))
	add("rate_limit", c.RateLimit.Validate())
	add("guard", c.Guard.Validate())
	add("savings", c.Savings.Validate())
	if len(c.Auth.Users) == 0 && !c.Auth.AllowUnauthenticated {
		// An open MITM proxy on a network is a liability: without users,
		// only loopback listeners are accepted.
		for _, l := range []struct{ key, addr string }{{"proxy.listen", c.Proxy.Listen}, {"socks5.listen", c.SOCKS5.Listen}} {
			if l.addr != "" && !listenaddr.Loopback(l.addr) {
				errs = append(errs, fmt.Errorf("auth.users: none configured while %s (%s) is not a loopback address: add users, or set auth.allow_unauthenticated: true if the port is protected otherwise", l.key, l.addr))
			}
		}
	}
	switch {
	case c.Admin.TokenEnv != "" && adminToken(c.Admin, getenv) == "":
		errs = append(errs, fmt.Errorf("admin.token_env: %s is unset or empty", c.Admin.TokenEnv))
	case c.Admin.TokenEnv == "" && c.Admin.Listen != "" && !listenaddr.Loopback(c.Admin.Listen) && !c.Auth.AllowUnauthenticated:
		// The admin API reloads the configuration, rotates sessions and
		// drops the cache: open to a network, it is anyone's. The switch
		// that opens the proxy ports (a container published on the
		// host's loopback) opens this one too.
		errs = append(errs, fmt.Errorf("admin.token_env: none configured while admin.listen (%s) is not a loopback address: anyone who reaches it could reload the configuration, rotate sessions and drop the cache; name a variable holding a token, or set auth.allow_unauthenticated: true if the port is protected otherwise", c.Admin.Listen))
	}
	if m := c.Process.MemoryLimit; m.Size > 0 {
		// The memory cache, once full, is always resident (spools and
		// certificates come and go). Said in whole MiB, rounded up.
		if least := (int64(c.Dedup.Memory.MaxBytes) + minMemoryHeadroom + 1<<20 - 1) &^ (1<<20 - 1); int64(m.Size) < least {
			errs = append(errs, fmt.Errorf("process.memory_limit: %s is below the memory cache (dedup.memory.max_bytes, %s) plus %s for the rest: at least %s; under it the collector runs without end once the cache fills. Raise it, lower dedup.memory.max_bytes, or use auto",
				m.Size, c.Dedup.Memory.MaxBytes, bytesize.Size(minMemoryHeadroom), bytesize.Size(least)))
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return &configError{errs: errs}
}

// configError lists every configuration problem, one per line.
type configError struct {
	errs []error
	// incomplete: decoding stopped at these problems, and what comes
	// after them was not read.
	incomplete bool
}

func (e *configError) Error() string {
	var b strings.Builder
	b.WriteString("invalid configuration:")
	for _, err := range e.errs {
		b.WriteString("\n  ")
		b.WriteString(err.Error())
	}
	return b.String()
}

func (e *configError) Unwrap() []error { return e.errs }

// Problems lists every problem, one per key.
func (e *configError) Problems() []string {
	out := make([]string, len(e.errs))
	for i, err := range e.errs {
		out[i] = err.Error()
	}
	return out
}

// flatten splits an errors.Join tree into its leaves.
func flatten(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []error
		for _, e := range j.Unwrap() {
			out = append(out, flatten(e)...)
		}
		return out
	}
	return []error{err}
}

func decodeStrict(r io.Reader, v any) error {
	// Configuration is small: read it whole, so a problem can be traced
	// back to the key that holds it.
	b, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	var root yaml.Node
	parsed := yaml.Unmarshal(b, &root) == nil
	rv := reflect.ValueOf(v).Elem()
	before := reflect.New(rv.Type()).Elem()
	before.Set(rv)
	err = decodeKnown(b, v)
	if errors.Is(err, io.EOF) {
		return nil // an empty file means "all defaults"
	}
	var te *yaml.TypeError
	var errs []error
	if err != nil && !errors.As(err, &te) {
		// yaml.v3 stops at the first value a TextUnmarshaler refuses (a
		// byte size, process.memory_limit) and returns its bare message,
		// with neither line nor key: find every such value again, by key,
		// and decode once more with each written over by a null (which
		// leaves its field as it was), so that the keys after the first
		// are read and checked too.
		if !parsed {
			return err
		}
		var refused []*yaml.Node
		errs, refused = textErrors(&root, reflect.TypeOf(v), "")
		if len(errs) == 0 {
			return err
		}
		blanked, ok := blankScalars(b, refused)
		if !ok {
			return &configError{errs: errs, incomplete: true}
		}
		rv.Set(before)
		if err = decodeKnown(blanked, v); err != nil && !errors.As(err, &te) {
			return &configError{errs: errs, incomplete: true}
		}
	}
	if parsed {
		errs = append(errs, fractionErrors(&root, reflect.TypeOf(v))...)
	}
	if err != nil {
		friendly := friendlyYAMLError(err, b)
		ce, ok := friendly.(*configError)
		if !ok {
			return friendly
		}
		errs = append(errs, ce.errs...)
	}
	if len(errs) == 0 {
		return nil
	}
	// Each kind of problem was found in document order: together, by line.
	slices.SortStableFunc(errs, func(a, b error) int { return cmp.Compare(lineOf(a), lineOf(b)) })
	return &configError{errs: errs}
}

// decodeKnown decodes doc into v, refusing keys v has no field for.
func decodeKnown(doc []byte, v any) error {
	dec := yaml.NewDecoder(bytes.NewReader(doc))
	dec.KnownFields(true)
	return dec.Decode(v)
}

var lineRE = regexp.MustCompile(`^line (\d+):`)

// lineOf is the line a problem names, 0 for none.
func lineOf(err error) int {
	if m := lineRE.FindStringSubmatch(err.Error()); m != nil {
		n, _ := strconv.Atoi(m[1])
		return n
	}
	return 0
}

// blankScalars returns doc with the text of each scalar of nodes written
// over by "~" (null) and spaces, every line and column kept, so that a
// second decoding names the lines the first did. It reports false when a
// scalar's text is not where and as its node says (a tag, a multi-line
// or block scalar): the caller then decodes no further.
func blankScalars(doc []byte, nodes []*yaml.Node) ([]byte, bool) {
	out := slices.Clone(doc)
	var starts []int // of each line
	starts = append(starts, 0)
	for i, c := range out {
		if c == '\n' {
			starts = append(starts, i+1)
		}
	}
	for _, n := range nodes {
		if n.Line < 1 || n.Line > len(starts) || n.Column < 1 {
			return nil, false
		}
		line := out[starts[n.Line-1]:]
		if i := bytes.IndexByte(line, '\n'); i >= 0 {
			line = line[:i]
		}
		// Column counts characters from 1.
		off, col := 0, 1
		for col < n.Column && off < len(line) {
			_, size := utf8.DecodeRune(line[off:])
			off += size
			col++
		}
		span := scalarSpan(line[off:], n)
		if col != n.Column || span == 0 {
			return nil, false
		}
		line[off] = '~'
		for i := off + 1; i < off+span; i++ {
			line[i] = ' '
		}
	}
	return out, true
}

// scalarSpan is the length of the scalar n's text at the start of text,
// 0 when text does not hold it whole.
func scalarSpan(text []byte, n *yaml.Node) int {
	switch n.Style {
	case 0:
		if bytes.HasPrefix(text, []byte(n.Value)) && len(n.Value) > 0 {
			return len(n.Value)
		}
	case yaml.DoubleQuotedStyle:
		for i := 1; i < len(text) && text[0] == '"'; i++ {
			switch text[i] {
			case '\\':
				i++
			case '"':
				return i + 1
			}
		}
	case yaml.SingleQuotedStyle:
		for i := 1; i < len(text) && text[0] == '\''; i++ {
			if text[i] == '\'' {
				if i+1 < len(text) && text[i+1] == '\'' {
					i++
					continue
				}
				return i + 1
			}
		}
	}
	return 0
}

var textUnmarshalerType = reflect.TypeFor[encoding.TextUnmarshaler]()

// textErrors returns, with its line and key path, every scalar of the
// YAML tree n that a text-unmarshalled field of t refuses, and those
// scalars' nodes. A document that is one bare value (an environment
// override) has no key to name and yields nothing.
func textErrors(n *yaml.Node, t reflect.Type, path string) ([]error, []*yaml.Node) {
	var refused []*yaml.Node
	errs := scalarErrors(n, t, path, func(n *yaml.Node, t reflect.Type, path string) error {
		if path == "" || !reflect.PointerTo(t).Implements(textUnmarshalerType) {
			return nil
		}
		u := reflect.New(t).Interface().(encoding.TextUnmarshaler)
		if err := u.UnmarshalText([]byte(n.Value)); err != nil {
			refused = append(refused, n)
			return &keyError{key: path, err: fmt.Errorf("line %d: %s: %w", n.Line, path, err)}
		}
		return nil
	})
	return errs, refused
}

// fractionErrors returns every number with a fraction that the YAML tree
// n puts in an integer field of t: yaml.v3 drops the fraction without a
// word (max_attempts: 2.9 runs with 2). A bare value (an environment
// override) is reported without a key; the caller names the variable.
func fractionErrors(n *yaml.Node, t reflect.Type) []error {
	return scalarErrors(n, t, "", func(n *yaml.Node, t reflect.Type, path string) error {
		switch t.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
			reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		default:
			return nil
		}
		// A duration or a type that parses its own text (a byte size)
		// reads a fraction itself.
		if t == reflect.TypeFor[time.Duration]() || reflect.PointerTo(t).Implements(textUnmarshalerType) || n.ShortTag() != "!!float" {
			return nil
		}
		if f, err := strconv.ParseFloat(strings.ReplaceAll(n.Value, "_", ""), 64); err != nil || f == math.Trunc(f) {
			return nil // 1e3 is 1000; what does not parse, yaml reports
		}
		if path == "" {
			return fmt.Errorf("%s is not a whole number", n.Value)
		}
		return &keyError{key: path, err: fmt.Errorf("line %d: %s: %s is not a whole number", n.Line, path, n.Value)}
	})
}

// scalarErrors walks the YAML tree n along the Go type t it decodes into
// and returns what check says of each non-null scalar, given its Go type
// and key path ("" for a document that is one bare value).
func scalarErrors(n *yaml.Node, t reflect.Type, path string, check func(n *yaml.Node, t reflect.Type, path string) error) []error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	var errs []error
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			errs = append(errs, scalarErrors(c, t, path, check)...)
		}
	case yaml.ScalarNode:
		if n.ShortTag() == "!!null" {
			return nil
		}
		if err := check(n, t, path); err != nil {
			errs = append(errs, err)
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := strings.TrimPrefix(path+"."+k.Value, ".")
			switch t.Kind() {
			case reflect.Struct:
				for j := 0; j < t.NumField(); j++ {
					if f := t.Field(j); yamlName(f) == k.Value {
						errs = append(errs, scalarErrors(v, f.Type, p, check)...)
					}
				}
			case reflect.Map:
				errs = append(errs, scalarErrors(v, t.Elem(), p, check)...)
			}
		}
	case yaml.SequenceNode:
		if t.Kind() == reflect.Slice || t.Kind() == reflect.Array {
			for i, c := range n.Content {
				errs = append(errs, scalarErrors(c, t.Elem(), fmt.Sprintf("%s[%d]", path, i), check)...)
			}
		}
	}
	return errs
}

var (
	unknownFieldRE    = regexp.MustCompile(`line (\d+): field (\S+) not found in type (\S+)`)
	typeErrorRE       = regexp.MustCompile("^line (\\d+): cannot unmarshal !!\\w+ `(.*)` into (\\S+)$")
	collectionErrorRE = regexp.MustCompile(`^line (\d+): cannot unmarshal !!(seq|map) into (\S+)$`)
)

// friendlyYAMLError rewrites yaml's messages into the key paths a user
// wrote: "field x not found in type proxy.Config" becomes "unknown key
// proxy.x", and "line 3: cannot unmarshal !!str `nope` into
// time.Duration" names the key whose value it is. Each problem is one
// entry of a configError.
func friendlyYAMLError(err error, doc []byte) error {
	var te *yaml.TypeError
	if err == nil || !errors.As(err, &te) {
		return err
	}
	var root yaml.Node
	_ = yaml.Unmarshal(doc, &root)
	sections := sectionNames()
	var errs []error
	for _, msg := range te.Errors {
		key := "" // the key whose value is refused
		if m := unknownFieldRE.FindStringSubmatch(msg); m != nil {
			name := m[2]
			if sec, ok := sections[m[3]]; ok && sec != "" {
				name = sec + "." + name
			}
			msg = fmt.Sprintf("line %s: unknown key %q", m[1], name)
		} else if m := typeErrorRE.FindStringSubmatch(msg); m != nil {
			line, _ := strconv.Atoi(m[1])
			what := m[3]
			if w, ok := wantOf[what]; ok {
				what = w
			}
			if key = keyAt(&root, "", line, m[2]); key != "" {
				msg = fmt.Sprintf("line %d: %s: %q is not %s", line, key, m[2], what)
			}
		} else if m := collectionErrorRE.FindStringSubmatch(msg); m != nil {
			// A list or mapping where a value goes: yaml names no key.
			line, _ := strconv.Atoi(m[1])
			kind, noun := yaml.SequenceNode, "a list"
			if m[2] == "map" {
				kind, noun = yaml.MappingNode, "a mapping"
			}
			what := m[3]
			if w, ok := wantOf[what]; ok {
				what = w
			}
			if key = collectionKeyAt(&root, "", line, kind); key != "" {
				msg = fmt.Sprintf("line %d: %s: %s is not %s", line, key, noun, what)
			}
		}
		errs = append(errs, &keyError{key: key, err: errors.New(msg)})
	}
	return &configError{errs: errs}
}

// wantOf says in words what a Go type expects.
var wantOf = map[string]string{
	"time.Duration": "a duration such as 45s",
	"int":           "a whole number",
	"int64":         "a whole number",
	"float64":       "a number",
	"bool":          "true or false",
	"string":        "a string",
}

// keyAt finds the key path of the scalar value at line in a YAML tree:
// the deepest mapping key on that line whose value is value.
func keyAt(n *yaml.Node, path string, line int, value string) string {
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			if k := keyAt(c, path, line, value); k != "" {
				return k
			}
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := strings.TrimPrefix(path+"."+k.Value, ".")
			if v.Kind == yaml.ScalarNode && v.Line == line && v.Value == value {
				return p
			}
			if found := keyAt(v, p, line, value); found != "" {
				return found
			}
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			if c.Kind == yaml.ScalarNode && c.Line == line && c.Value == value {
				return fmt.Sprintf("%s[%d]", path, i)
			}
			if found := keyAt(c, fmt.Sprintf("%s[%d]", path, i), line, value); found != "" {
				return found
			}
		}
	}
	return ""
}

// collectionKeyAt finds the key path of the list or mapping of kind that
// starts at line in a YAML tree: the deepest, for a section's own mapping
// starts on the line of its first key.
func collectionKeyAt(n *yaml.Node, path string, line int, kind yaml.Kind) string {
	found := ""
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			if k := collectionKeyAt(c, path, line, kind); k != "" {
				found = k
			}
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := strings.TrimPrefix(path+"."+k.Value, ".")
			if v.Kind == kind && v.Line == line {
				found = p
			}
			if deeper := collectionKeyAt(v, p, line, kind); deeper != "" {
				found = deeper
			}
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			p := fmt.Sprintf("%s[%d]", path, i)
			if c.Kind == kind && c.Line == line {
				found = p
			}
			if deeper := collectionKeyAt(c, p, line, kind); deeper != "" {
				found = deeper
			}
		}
	}
	return found
}

// sectionNames maps Go type names ("proxy.Config") to their yaml key path.
func sectionNames() map[string]string {
	out := map[string]string{}
	var walk func(t reflect.Type, path string)
	walk = func(t reflect.Type, path string) {
		out[t.String()] = path
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			name := yamlName(f)
			if name == "" {
				continue
			}
			ft := f.Type
			for ft.Kind() == reflect.Slice || ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if isSection(ft) {
				walk(ft, strings.TrimPrefix(path+"."+name, "."))
			}
		}
	}
	walk(reflect.TypeFor[Config](), "")
	return out
}

// isSection reports whether a struct type is a section of keys rather than
// one value: time.Duration-like and text-unmarshalled types are values.
func isSection(t reflect.Type) bool {
	return t.Kind() == reflect.Struct && t.PkgPath() != "time" &&
		!reflect.PointerTo(t).Implements(reflect.TypeFor[encoding.TextUnmarshaler]())
}

func yamlName(f reflect.StructField) string {
	tag := f.Tag.Get("yaml")
	name, _, _ := strings.Cut(tag, ",")
	if name == "-" || !f.IsExported() {
		return ""
	}
	return name
}

// configKey is one settable configuration key.
type configKey struct {
	path  string // yaml path, "proxy.listen"
	field reflect.Value
}

// envKeys maps every ONCEPROXY_* variable name to the configuration key it
// sets: the yaml path upper-cased with '.' turned into '_'.
func envKeys(cfg *Config) map[string]configKey {
	out := map[string]configKey{}
	var walk func(v reflect.Value, path string)
	walk = func(v reflect.Value, path string) {
		t := v.Type()
		for i := 0; i < t.NumField(); i++ {
			name := yamlName(t.Field(i))
			if name == "" {
				continue
			}
			p := strings.TrimPrefix(path+"."+name, ".")
			fv := v.Field(i)
			if isSection(fv.Type()) {
				walk(fv, p)
				continue
			}
			out[envPrefix+strings.ToUpper(strings.NewReplacer(".", "_", "-", "_").Replace(p))] = configKey{p, fv}
		}
	}
	walk(reflect.ValueOf(cfg).Elem(), "")
	return out
}

// applyEnv sets configuration fields from ONCEPROXY_* variables. An unknown
// ONCEPROXY_ variable is an error (a typo must not silently do nothing),
// unless a *_env key names it: ONCEPROXY_FLEET_PASSWORD holding a user's
// password is the config's own example.
func applyEnv(cfg *Config, environ []string) error {
	keys := envKeys(cfg)
	var errs []error
	var unknown []string
	for _, kv := range environ {
		name, val, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(name, envPrefix) {
			continue
		}
		k, known := keys[name]
		field := k.field
		if !known {
			unknown = append(unknown, name)
			continue
		}
		if val == "" {
			// An empty variable clears the key (e.g. ONCEPROXY_UPSTREAM_URL=
			// for direct); YAML would read it as "no document". A list
			// cleared is empty, not nil: the sections read a nil list as
			// unset and fill in their default one.
			if field.Kind() == reflect.Slice {
				field.Set(reflect.MakeSlice(field.Type(), 0, 0))
			} else {
				field.Set(reflect.Zero(field.Type()))
			}
			continue
		}
		if literal(field) {
			// A string is taken as it is: read as YAML, a password
			// "s3cret #1" would lose its "comment", and "~" would be
			// no password at all.
			field.SetString(val)
			continue
		}
		if list, ok := commaList(field, val); ok {
			field.Set(list)
			continue
		}
		doc := val
		if scalarList(field.Type()) && !yamlList(val) {
			doc = "[" + val + "]" // "200, 404" as [200, 404]
		}
		before := reflect.New(field.Type()).Elem()
		before.Set(field)
		if err := decodeStrict(strings.NewReader(doc), field.Addr().Interface()); err != nil {
			errs = append(errs, envValueError(name, val, field.Type(), err))
			// The checks that follow see the key as it was before the
			// variable, not a list decoded in part or 2 for 2.9.
			field.Set(before)
		}
	}
	named := envReferences(reflect.ValueOf(cfg).Elem())
	for _, name := range unknown {
		if !named[name] {
			errs = append(errs, fmt.Errorf("%s: unknown variable (see README, Configuration)", name))
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return &configError{errs: errs}
}

// commaList reads val as a list of strings written as NO_PROXY is
// ("a.com, b.com"), for a key that holds plain strings and a value that is
// not YAML's list syntax ("[a.com]", "- a.com").
func commaList(field reflect.Value, val string) (reflect.Value, bool) {
	t := field.Type()
	if t.Kind() != reflect.Slice || t.Elem().Kind() != reflect.String || !literal(reflect.New(t.Elem()).Elem()) {
		return reflect.Value{}, false
	}
	if yamlList(val) {
		return reflect.Value{}, false
	}
	list := reflect.MakeSlice(t, 0, strings.Count(val, ",")+1)
	for item := range strings.SplitSeq(val, ",") {
		if item = strings.TrimSpace(item); item != "" {
			list = reflect.Append(list, reflect.ValueOf(item).Convert(t.Elem()))
		}
	}
	return list, true
}

// yamlList reports a value written in YAML's list syntax.
func yamlList(val string) bool {
	trimmed := strings.TrimSpace(val)
	return strings.HasPrefix(trimmed, "[") || strings.HasPrefix(trimmed, "-")
}

// scalarList reports a list of values that are neither sections nor
// lists (numbers, durations, sizes): a variable may set it comma-separated.
func scalarList(t reflect.Type) bool {
	if t.Kind() != reflect.Slice {
		return false
	}
	switch e := t.Elem(); e.Kind() {
	case reflect.Slice, reflect.Map, reflect.Pointer, reflect.Interface:
		return false
	case reflect.Struct:
		return !isSection(e)
	}
	return true
}

// envValueError says what the key a variable sets expects, when YAML's
// own message ("cannot unmarshal !!str `lots` into int") names a Go type
// and no key; a value type that explains itself (a byte size) keeps its
// message.
func envValueError(name, val string, t reflect.Type, err error) error {
	want, ok := wantOf[t.String()]
	switch {
	case ok:
	case scalarList(t):
		want = "a list: a, b or [a, b]"
		if w, ok := wantOf[t.Elem().String()]; ok {
			want = "a list (a, b or [a, b]), each " + w
		}
	case t.Kind() == reflect.Slice && !shaped(val, yaml.SequenceNode):
		want = "a YAML list such as [{...}, {...}]"
	case (t.Kind() == reflect.Map || isSection(t)) && !shaped(val, yaml.MappingNode):
		want = "a YAML mapping such as {key: value}"
	default:
		// A list or mapping of the right shape: what is wrong is inside
		// it (a typo in a rule's key, a bad duration), and the decoder
		// said where.
		var ce *configError
		if errors.As(err, &ce) {
			return fmt.Errorf("%s: %s", name, strings.Join(ce.Problems(), "; "))
		}
		return fmt.Errorf("%s: %w", name, err)
	}
	if len(val) > 60 {
		val = val[:60] + "..."
	}
	return fmt.Errorf("%s: %q is not %s", name, val, want)
}

// shaped reports whether val is YAML whose top is of kind: a list or
// mapping written as one.
func shaped(val string, kind yaml.Kind) bool {
	var doc yaml.Node
	return yaml.Unmarshal([]byte(val), &doc) == nil && len(doc.Content) == 1 && doc.Content[0].Kind == kind
}

// literal reports a string key that a variable sets as it is: a plain
// string, not a type that parses its value.
func literal(field reflect.Value) bool {
	if field.Kind() != reflect.String {
		return false
	}
	switch field.Addr().Interface().(type) {
	case yaml.Unmarshaler, encoding.TextUnmarshaler:
		return false
	}
	return true
}

// envReferences collects the variable names the *_env keys of v name
// (auth.users[].password_env, admin.token_env, ...), wherever they are.
func envReferences(v reflect.Value) map[string]bool {
	out := map[string]bool{}
	var walk func(v reflect.Value)
	walk = func(v reflect.Value) {
		switch v.Kind() {
		case reflect.Pointer, reflect.Interface:
			if !v.IsNil() {
				walk(v.Elem())
			}
		case reflect.Slice, reflect.Array:
			for i := range v.Len() {
				walk(v.Index(i))
			}
		case reflect.Map:
			for _, k := range v.MapKeys() {
				walk(v.MapIndex(k))
			}
		case reflect.Struct:
			t := v.Type()
			for i := range t.NumField() {
				name := yamlName(t.Field(i))
				if name == "" {
					continue
				}
				if f := v.Field(i); strings.HasSuffix(name, "_env") && f.Kind() == reflect.String {
					out[f.String()] = true
				} else {
					walk(f)
				}
			}
		}
	}
	walk(v)
	return out
}

// LookupEnv returns the value of name in environ ("" if unset).
func LookupEnv(environ []string, name string) string {
	v, _ := lookupEnvSet(environ, name)
	return v
}

// envNames lists the override variables, for docs and tests.
func envNames(cfg *Config) []string {
	keys := envKeys(cfg)
	names := make([]string, 0, len(keys))
	for k := range keys {
		names = append(names, k)
	}
	sort.Strings(names)
	return names
}

// NewLogger builds the process logger from the log section. Its level is
// the returned LevelVar, which a reload sets. Warnings and errors are
// limited per message (loglimit's defaults: 20 lines per 10s), for a
// client can make the proxy warn at will and so fill the disk; Build
// counts what is left out in onceproxy_log_lines_suppressed_total.
func NewLogger(c LogConfig, w io.Writer) (*slog.Logger, *slog.LevelVar) {
	var level slog.Level
	_ = level.UnmarshalText([]byte(c.Level))
	lv := new(slog.LevelVar)
	lv.Set(level)
	opts := &slog.HandlerOptions{Level: lv}
	var h slog.Handler = logtext.New(w, opts)
	if c.Format == "json" {
		h = slog.NewJSONHandler(w, opts)
	}
	return slog.New(loglimit.New(h, loglimit.Config{})), lv
}
