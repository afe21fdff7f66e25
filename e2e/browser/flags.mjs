// Chromium flags shared by the e2e browser scripts. e2e/chromium_test.go
// passes the same list to the plain chromium runs.

// Flags that keep Chromium's own background traffic (updates, safe
// browsing, sync, field trials, DNS prefetch) from leaving the machine.
export const quietFlags = [
  '--headless',
  '--no-sandbox',
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--disable-default-apps',
  '--disable-extensions',
  '--disable-domain-reliability',
  '--disable-client-side-phishing-detection',
  '--no-pings',
  '--dns-prefetch-disable',
  '--disable-features=OptimizationHints,MediaRouter,Translate,AutofillServerCommunication,CertificateTransparencyComponentUpdater,NetworkTimeServiceQuerying',
  // Fence for the test sandbox, which only loopback may be dialled in: a
  // host that is not loopback goes direct (fenceBypass) and fails in
  // Chromium's own resolver, reaching neither the proxy nor a DNS server.
  // (Without it, Chromium 156 still sends update.googleapis.com and
  // accounts.google.com requests to the proxy despite the flags above.)
  '--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1',
];

// The proxy bypass list the tests use: Chromium evaluates the rules from
// the last one back, so loopback ("<-loopback>" lifts the implicit loopback
// bypass) goes through the proxy and everything else ("*") goes direct,
// into the resolver fence. ("<-loopback>,*" would bypass loopback too.)
export const fenceBypass = '*,<-loopback>';
