// Package e2e runs the real onceproxy program against real clients: headless
// Chromium (Debian's, driven by flags, Playwright and Puppeteer), Python
// requests, and curl, all on loopback.
//
// Each test builds nothing itself: TestMain builds the onceproxy binary once
// and every test starts it as a subprocess on free loopback ports, next to a
// loopback HTTPS origin that counts what reaches it. A test whose client is
// missing fails when the CI variable is set and is skipped otherwise.
//
// Set E2E_ARTIFACTS to choose where screenshots go (default e2e/artifacts).
package e2e
