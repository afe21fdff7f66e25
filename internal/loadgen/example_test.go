package loadgen_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/loadgen"
)

// A stampede: 50 identical requests, 10 at a time, against a TLS origin.
// Add Proxy (and the proxy's CA as CAFile) to send them through onceproxy;
// res.XCache then shows how many it coalesced.
func ExampleRun() {
	origin, err := loadgen.StartOrigin(loadgen.OriginOptions{
		TLS:      true,
		Latency:  10 * time.Millisecond,
		BodySize: 1024,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer origin.Close()

	res, err := loadgen.Run(context.Background(), loadgen.Options{
		CAFile:  origin.CAFile(),
		Targets: []string{origin.URL() + "/item/0?q=0"},
		N:       50,
		C:       10,
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("requests:", res.Requests, "errors:", res.Errors, "status 200:", res.Status[200])
	fmt.Println("origin saw:", origin.Requests())
	// Output:
	// requests: 50 errors: 0 status 200: 50
	// origin saw: 50
}
