package postgres

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestRetryable(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		err  error
		want bool
	}{
		"serialization failure": {&pgconn.PgError{Code: "40001"}, true},
		"deadlock, wrapped":     {fmt.Errorf("acquire: %w", &pgconn.PgError{Code: "40P01"}), true},
		"unique violation":      {&pgconn.PgError{Code: "23505"}, false},
		"not PostgreSQL":        {errors.New("boom"), false},
		"nil":                   {nil, false},
	}
	for name, tc := range cases {
		if got := Retryable(tc.err); got != tc.want {
			t.Errorf("%s: Retryable = %v, want %v", name, got, tc.want)
		}
	}
}
