// Package redistest runs a real redis-server for tests: on a free loopback
// port, owned by the test, so a test can kill and restart it. When
// redis-server is not installed it falls back to REDIS_URL (a server the
// test cannot kill: tests that need Kill are skipped), and skips the test
// with a message when neither exists, unless CI is set (then it fails: CI
// must provide Redis).
package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// Server is one redis-server process.
type Server struct {
	t    testing.TB
	Addr string // host:port
	URL  string // redis://host:port/0
	cmd  *exec.Cmd
	dir  string
	own  bool          // started by us (can Kill/Restart)
	info *redis.Client // Stats's
	args []string      // beyond the defaults (cluster mode)
}

// Start starts a private redis-server and stops it when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if u := os.Getenv("REDIS_URL"); u != "" {
			opts, err := redis.ParseURL(u)
			if err != nil {
				t.Fatalf("REDIS_URL: %v", err)
			}
			return &Server{t: t, Addr: opts.Addr, URL: u}
		}
		if os.Getenv("CI") != "" {
			t.Fatal("redis-server not found and REDIS_URL unset: CI must provide Redis")
		}
		t.Skip("needs redis-server on PATH or REDIS_URL")
	}
	return startOwn(t, bin)
}

// startOwn starts a redis-server with args beyond the defaults.
func startOwn(t testing.TB, bin string, args ...string) *Server {
	s := &Server{t: t, dir: t.TempDir(), own: true, args: args}
	s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(testkit.ServerPort(t)))
	s.URL = "redis://" + s.Addr + "/0"
	s.start(bin)
	t.Cleanup(s.stop)
	return s
}

// StartCluster starts a Redis Cluster of n private masters (no replicas),
// the hash slots split evenly between them, and returns their addresses
// once every node reports the cluster ok. Without redis-server it skips,
// or fails under CI: a REDIS_URL server is no cluster.
func StartCluster(t testing.TB, n int) []string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("redis-server not found: CI must provide it for the Cluster tests")
		}
		t.Skip("needs redis-server on PATH to start a cluster")
	}
	const slots = 16384
	ctx := context.Background()
	addrs := make([]string, n)
	buses := make([]string, n)
	nodes := make([]*redis.Client, n)
	for i := range n {
		// The bus port too is drawn below the ephemeral range: Redis's
		// default, the port plus 10000, can land inside it and be taken
		// by an outgoing connection (the node then fails to start).
		buses[i] = strconv.Itoa(testkit.ServerPort(t))
		s := startOwn(t, bin, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
			"--cluster-port", buses[i])
		addrs[i] = s.Addr
		nodes[i] = redis.NewClient(&redis.Options{Addr: s.Addr})
		defer nodes[i].Close()
		if err := nodes[i].Do(ctx, "CLUSTER", "ADDSLOTSRANGE", i*slots/n, (i+1)*slots/n-1).Err(); err != nil {
			t.Fatalf("cluster: node %s: ADDSLOTSRANGE: %v", s.Addr, err)
		}
	}
	for i, a := range addrs[1:] {
		host, port, _ := net.SplitHostPort(a)
		if err := nodes[0].Do(ctx, "CLUSTER", "MEET", host, port, buses[i+1]).Err(); err != nil {
			t.Fatalf("cluster: MEET %s: %v", a, err)
		}
	}
	want := fmt.Sprintf("cluster_known_nodes:%d", n)
	deadline := time.Now().Add(20 * time.Second)
	for i, c := range nodes {
		for {
			info, err := c.ClusterInfo(ctx).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") && strings.Contains(info, want) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("cluster: node %s not ready: %v\n%s", addrs[i], err, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return addrs
}

func (s *Server) start(bin string) {
	_, port, _ := net.SplitHostPort(s.Addr)
	args := append([]string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", s.dir, "--daemonize", "no", "--loglevel", "warning"}, s.args...)
	s.cmd = exec.Command(bin, args...)
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("start redis-server: %v", err)
	}
	s.waitReady()
}

func (s *Server) waitReady() {
	c := redis.NewClient(&redis.Options{Addr: s.Addr, DialTimeout: 200 * time.Millisecond, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("redis-server on %s not ready: %v", s.Addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Kill stops the server abruptly (SIGKILL), like a crash or a network cut.
func (s *Server) Kill() {
	s.t.Helper()
	if !s.own {
		s.t.Skip("cannot kill a REDIS_URL server")
	}
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
		s.cmd = nil
	}
}

// Restart starts the server again on the same port (with empty data).
func (s *Server) Restart() {
	s.t.Helper()
	s.Kill()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		s.t.Fatal(err)
	}
	s.start(bin)
}

func (s *Server) stop() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
	}
}

// Client returns a plain client to inspect the server from a test.
func (s *Server) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	s.t.Cleanup(func() { c.Close() })
	return c
}

// String describes the server for test logs.
func (s *Server) String() string { return fmt.Sprintf("redis %s (own=%v)", s.Addr, s.own) }

// Stats is what the server counts of its own work so far, from INFO.
type Stats struct {
	// Commands is total_commands_processed: every command, a script's own
	// calls included.
	Commands int64
	// Reads is total_reads_processed: one per command or pipeline read.
	Reads int64
	// CPU is used_cpu_user plus used_cpu_sys.
	CPU time.Duration
}

// Stats reads the server's INFO stats and cpu sections.
func (s *Server) Stats() Stats {
	s.t.Helper()
	if s.info == nil {
		// One connection for every read, set up before the first one:
		// a new connection's own commands would count in between.
		s.info = s.Client()
	}
	info, err := s.info.Info(context.Background(), "stats", "cpu").Result()
	if err != nil {
		s.t.Fatalf("redis INFO: %v", err)
	}
	var st Stats
	for line := range strings.Lines(info) {
		name, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok {
			continue
		}
		switch name {
		case "total_commands_processed":
			st.Commands, _ = strconv.ParseInt(v, 10, 64)
		case "total_reads_processed":
			st.Reads, _ = strconv.ParseInt(v, 10, 64)
		case "used_cpu_user", "used_cpu_sys":
			f, _ := strconv.ParseFloat(v, 64)
			st.CPU += time.Duration(f * float64(time.Second))
		}
	}
	return st
}
