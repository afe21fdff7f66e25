package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestReadmeRecipesAreTested keeps the README's client recipes honest:
// every subsection of its "## Clients" section names the tests that run
// its recipes (`TestX` for this package, `proxy.TestX` for the proxy
// package) or says "not tested", and every test it names exists.
// $E2E_README checks another file (a draft of the section).
func TestReadmeRecipesAreTested(t *testing.T) {
	path := os.Getenv("E2E_README")
	if path == "" {
		path = filepath.Join(repoRoot, "README.md")
	}
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	_, section, found := strings.Cut("\n"+string(src), "\n## Clients")
	if !found {
		t.Skipf("%s has no \"## Clients\" section yet", path)
	}
	if i := strings.Index(section, "\n## "); i >= 0 {
		section = section[:i]
	}
	defined := map[string]bool{}
	for _, dir := range []string{"e2e", "proxy"} {
		files, _ := filepath.Glob(filepath.Join(repoRoot, dir, "*_test.go"))
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range regexp.MustCompile(`(?m)^func (Test\w+)\(t \*testing\.T\)`).FindAllStringSubmatch(string(b), -1) {
				if dir == "proxy" {
					defined["proxy."+m[1]] = true
				} else {
					defined[m[1]] = true
				}
			}
		}
	}
	ref := regexp.MustCompile("`((?:proxy\\.)?Test\\w+)`")
	subsections := strings.Split(section, "\n### ")[1:]
	if len(subsections) == 0 {
		t.Fatalf("the Clients section of %s has no ### subsections", path)
	}
	for _, sub := range subsections {
		heading, _, _ := strings.Cut(sub, "\n")
		if !ref.MatchString(heading) && !strings.Contains(heading, "not tested") {
			t.Errorf("### %s: the heading names no test and does not say \"not tested\"", heading)
		}
		for _, m := range ref.FindAllStringSubmatch(sub, -1) {
			if !defined[m[1]] {
				t.Errorf("### %s: names %s, which does not exist", heading, m[1])
			}
		}
	}
	t.Logf("%d recipe subsections checked in %s", len(subsections), path)
}
