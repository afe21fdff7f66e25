// Package pgtest gives tests a real PostgreSQL.
//
// Start runs a private cluster (initdb and pg_ctl from the PostgreSQL
// binaries, on a free loopback port, in a directory the test owns), so a
// test can stop and restart it. As root, the server runs as the postgres
// user, which initdb requires. When that does not work (no binaries, no
// postgres user) it falls back to PG_URL (a server the test cannot stop:
// tests that need Stop are skipped), and skips the test with a message
// when neither works, unless CI is set (then it fails: CI must provide
// PostgreSQL).
//
// Schema hands a test its own schema on the long-running server at PG_URL,
// or 127.0.0.1:5432 database test: tests that never stop the server share
// it, each in a schema dropped when it ends.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// DefaultURL is the long-running server of the development machines and
// CI, used by Schema when PG_URL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// Server is one PostgreSQL server for a test.
type Server struct {
	t testing.TB
	// URL connects to the server's postgres database as the superuser.
	URL string
	own bool // a cluster of ours: Stop and Start work

	bin      string // directory of initdb and pg_ctl
	dir      string // owned by the server's user: data/, the socket, log
	port     int
	run      []string // prefix that runs a command as the server's user
	settings []string // name=value server settings
}

// Start starts a private PostgreSQL cluster and removes it when the test
// ends. settings are server settings as name=value
// ("shared_preload_libraries=pg_stat_statements"); a PG_URL server has
// its own.
func Start(t testing.TB, settings ...string) *Server {
	t.Helper()
	s, err := startCluster(t, settings)
	if err == nil {
		return s
	}
	if u := os.Getenv("PG_URL"); u != "" {
		t.Logf("no private PostgreSQL (%v): using PG_URL, which this test cannot stop", err)
		return &Server{t: t, URL: u}
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("no private PostgreSQL (%v) and PG_URL unset: CI must provide PostgreSQL", err)
	}
	t.Skipf("needs the PostgreSQL server binaries (initdb, pg_ctl) or PG_URL: %v", err)
	return nil
}

// startCluster runs initdb and pg_ctl start in a directory of the test's.
func startCluster(t testing.TB, settings []string) (*Server, error) {
	bin := binDir()
	if bin == "" {
		return nil, errors.New("initdb and pg_ctl not found in /usr/lib/postgresql/*/bin or PATH")
	}
	s := &Server{t: t, bin: bin, own: true, port: testkit.ServerPort(t), settings: settings}
	dir, err := os.MkdirTemp("", "pgtest-")
	if err != nil {
		return nil, err
	}
	s.dir = dir
	t.Cleanup(func() { s.stop(); os.RemoveAll(dir) })
	if os.Geteuid() == 0 {
		// initdb refuses to run as root: the cluster belongs to postgres.
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root needs a postgres user for the cluster: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			return nil, err
		}
		s.run = []string{"runuser", "-u", "postgres", "--"}
	}
	if err := s.cmd(30*time.Second, filepath.Join(bin, "initdb"), "-D", s.data(), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"); err != nil {
		return nil, err
	}
	s.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
	if err := s.start(); err != nil {
		return nil, err
	}
	return s, nil
}

// binDir finds initdb and pg_ctl: the newest /usr/lib/postgresql/*/bin
// (Debian keeps them off PATH), else PATH.
func binDir() string {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "pg_ctl")); err == nil {
			return d
		}
	}
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		if _, err := exec.LookPath("initdb"); err == nil {
			return filepath.Dir(p)
		}
	}
	return ""
}

func version(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

func (s *Server) data() string { return filepath.Join(s.dir, "data") }

// cmd runs a PostgreSQL program as the server's user; its error carries
// the program's output and the server log.
func (s *Server) cmd(timeout time.Duration, args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	args = append(append([]string(nil), s.run...), args...)
	out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(s.dir, "log"))
		return fmt.Errorf("%s: %v\n%s\nserver log:\n%s", strings.Join(args, " "), err, out, log)
	}
	return nil
}

// Start starts the server again after Stop, on the same port and data, and
// returns once it accepts connections.
func (s *Server) Start() {
	s.t.Helper()
	s.mustOwn()
	if err := s.start(); err != nil {
		s.t.Fatal(err)
	}
}

func (s *Server) start() error {
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off", s.port, s.dir)
	for _, kv := range s.settings {
		opts += " -c " + kv
	}
	if err := s.cmd(60*time.Second, filepath.Join(s.bin, "pg_ctl"), "-D", s.data(), "-l", filepath.Join(s.dir, "log"), "-w", "-t", "60", "-o", opts, "start"); err != nil {
		return err
	}
	return s.waitReady()
}

// Stop stops the server at once (pg_ctl -m immediate), as a crash would:
// sessions end without goodbye, and unlogged tables are empty when it
// starts again.
func (s *Server) Stop() {
	s.t.Helper()
	s.mustOwn()
	if err := s.cmd(60*time.Second, filepath.Join(s.bin, "pg_ctl"), "-D", s.data(), "-m", "immediate", "-w", "stop"); err != nil {
		s.t.Fatal(err)
	}
}

func (s *Server) mustOwn() {
	if !s.own {
		s.t.Skip("cannot stop or start a PG_URL server")
	}
}

// stop is the cleanup: the server must not outlive the test, whatever
// state it is in.
func (s *Server) stop() {
	if _, err := os.Stat(filepath.Join(s.data(), "postmaster.pid")); err != nil {
		return
	}
	args := append(append([]string(nil), s.run...), filepath.Join(s.bin, "pg_ctl"), "-D", s.data(), "-m", "immediate", "-w", "stop")
	_ = exec.Command(args[0], args[1:]...).Run()
}

func (s *Server) waitReady() error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		c, err := pgx.Connect(ctx, s.URL)
		if err == nil {
			c.Close(ctx)
			cancel()
			return nil
		}
		cancel()
		if time.Now().After(deadline) {
			return fmt.Errorf("postgres on port %d not ready: %w", s.port, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Exec runs sql on the server as the superuser, for a test to set up or
// inspect state.
func (s *Server) Exec(sql string, args ...any) {
	s.t.Helper()
	Exec(s.t, s.URL, sql, args...)
}

// Exec runs sql on the server at dsn.
func Exec(t testing.TB, dsn, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("connect %s: %v", redact(dsn), err)
	}
	defer c.Close(context.Background())
	if _, err := c.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// Schema returns the URL of the long-running server (PG_URL, else
// DefaultURL) and a schema name of the test's own, dropped when the test
// ends. When that server does not answer, a private one is started.
func Schema(t testing.TB) (dsn, schema string) {
	t.Helper()
	dsn = os.Getenv("PG_URL")
	if dsn == "" {
		dsn = DefaultURL
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Logf("the shared PostgreSQL at %s does not answer (%v): starting one for this test", redact(dsn), err)
		dsn = Start(t).URL
	} else {
		c.Close(ctx)
	}
	schema = SchemaName(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if c, err := pgx.Connect(ctx, dsn); err == nil {
			_, _ = c.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
			c.Close(ctx)
		}
	})
	return dsn, schema
}

// SchemaName makes a schema name unique to one run of the test: a short
// form of its name and a random suffix.
func SchemaName(t testing.TB) string {
	var b strings.Builder
	b.WriteString("t_")
	for _, r := range strings.ToLower(t.Name()) {
		if b.Len() >= 30 {
			break
		}
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
		}
	}
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	return b.String() + "_" + hex.EncodeToString(suffix)
}

// redact drops the password from a URL for test logs.
func redact(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "(unparsable URL)"
	}
	return p.Redacted()
}
