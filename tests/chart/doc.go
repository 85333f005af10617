// Package chart renders and installs the Helm chart in deploy/helm for its
// tests: render tests decode every manifest strictly into Kubernetes types
// (run by `make test`); the cluster tests in ./cluster install it into a
// real API server (`make test-cluster`).
package chart
