// Package e2e holds the end-to-end tests (build tag e2e): every service as
// a real process over real PostgreSQL and NATS. Run them with `make test-e2e`.
package e2e
