package proxy

// LeanWatches is how many watches for a client going away the lean loop
// has started (tunnel_h1.go), for tests of what a request costs.
func (s *Server) LeanWatches() int64 {
	return s.port.conns.watches.Load() + s.tunnels.conns.watches.Load()
}
