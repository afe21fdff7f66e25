package httpstatus_test

import (
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
)

type forbidden struct{}

func (forbidden) Error() string   { return "no" }
func (forbidden) HTTPStatus() int { return http.StatusForbidden }

func TestOf(t *testing.T) {
	if st, ok := httpstatus.Of(fmt.Errorf("dial: %w", forbidden{})); !ok || st != http.StatusForbidden {
		t.Errorf("wrapped: %d %v", st, ok)
	}
	if st, ok := httpstatus.Of(errors.New("plain")); ok || st != 0 {
		t.Errorf("plain error: %d %v", st, ok)
	}
	if _, ok := httpstatus.Of(nil); ok {
		t.Error("nil error carries a status")
	}
}

// TestLine is net/http's status line for every code, named or not.
func TestLine(t *testing.T) {
	for _, code := range []int{0, 99, 100, 200, 206, 299, 304, 418, 599, 600, 1000, -1} {
		if got, want := httpstatus.Line(code), fmt.Sprintf("%d %s", code, http.StatusText(code)); got != want {
			t.Errorf("Line(%d) = %q, want %q", code, got, want)
		}
	}
}
