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
