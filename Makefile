# egress-proxies: the two commands a new user needs are `make run` and
# `make test`; the rest keeps the contracts, generated code and style honest.

SHELL  := /bin/bash
MODULE := github.com/egress-proxies/egress-proxies
SERVICES := orchestrator lease health console gateway provisioner-local provisioner-proxmox provisioner-kvm provisioner-gcp provisioner-kubernetes
# What `make run` builds and starts: the suite with the local backend (the
# other backends' SDKs and client libraries are most of a cold build).
RUN_SERVICES := orchestrator lease health console gateway provisioner-local

# Tools are built from the versions pinned in tools/ and cached outside the
# checkout, keyed by those pins, so fresh clones (CI) reuse them.
TOOLS_KEY := $(shell cat tools/go.mod tools/go.sum tools/helm/go.mod tools/helm/go.sum 2>/dev/null | sha256sum | cut -c1-12)
TOOLS_BIN ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/egress-proxies/tools-$(TOOLS_KEY)
export PATH := $(TOOLS_BIN):$(PATH)
BUF := $(TOOLS_BIN)/buf
HELM := $(TOOLS_BIN)/helm

# The breaking-change check compares proto/ against this image unless told
# otherwise (for example BREAKING_AGAINST='.git#branch=main').
API_BASELINE := proto/api-baseline.json
BREAKING_AGAINST ?= $(API_BASELINE)

GO_TEST_FLAGS ?= -race -count=1 -timeout 30m

# Images are egress-proxies/<name>:$(VERSION); the chart's appVersion is
# the tag it installs by default.
VERSION ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' deploy/helm/egress-proxies/Chart.yaml)
IMAGES := $(SERVICES) egressctl
CHART := deploy/helm/egress-proxies
# The values files the chart's tests install with.
CHART_VALUES := $(wildcard tests/chart/testdata/*.yaml)

.PHONY: bench-gateway bench-scale console-screenshots all tools third-party generate check-generated lint breaking api-baseline build test test-e2e test-cluster images test-images k8s-tools run helm-lint clean

all: lint build test

## tools: build buf, the protoc plugins and helm at their pinned versions
tools: $(TOOLS_BIN)/.stamp
$(TOOLS_BIN)/.stamp: tools/go.mod tools/go.sum tools/helm/go.mod tools/helm/go.sum
	@mkdir -p $(TOOLS_BIN)
	cd tools && GOWORK=off go build -o $(TOOLS_BIN)/ \
		github.com/bufbuild/buf/cmd/buf \
		google.golang.org/protobuf/cmd/protoc-gen-go \
		google.golang.org/grpc/cmd/protoc-gen-go-grpc \
		github.com/grpc-ecosystem/grpc-gateway/v2/protoc-gen-grpc-gateway \
		github.com/grpc-ecosystem/grpc-gateway/v2/protoc-gen-openapiv2
	cd tools/helm && GOWORK=off go build -o $(TOOLS_BIN)/ helm.sh/helm/v3/cmd/helm
	@touch $@

## third-party: copy google/api and openapiv2 option protos from pinned Go modules
third-party: third_party/.stamp
third_party/.stamp: scripts/third-party-protos.sh tools/go.mod
	scripts/third-party-protos.sh
	@touch $@

## generate: regenerate Go code and the OpenAPI document from proto/ (with the buf.validate rules written into it)
generate: tools third-party
	rm -rf pkg/api/egress pkg/api/openapi
	$(BUF) generate
	go run ./pkg/validate/openapirules pkg/api/openapi/egress.swagger.json

## check-generated: fail when committed generated code differs from a fresh generation
check-generated: generate
	@if [ -n "$$(git status --porcelain -- pkg/api)" ]; then \
		echo "generated code is stale; run 'make generate' and commit:"; \
		git status --porcelain -- pkg/api; git --no-pager diff --stat -- pkg/api; exit 1; \
	fi

## lint: gofmt, go vet, buf lint, buf format, helm lint
lint: tools third-party
	@out=$$(gofmt -l pkg services cmd tests clients examples); if [ -n "$$out" ]; then echo "not gofmt-ed:"; echo "$$out"; exit 1; fi
	go vet $(MODULE)/...
	go vet -tags e2e ./tests/e2e/
	go vet -tags proxmox_integration ./services/provisioner-proxmox/...
	go vet -tags cluster ./tests/chart/...
	go vet -tags cluster ./services/provisioner-kubernetes/...
	go vet -tags crashpoints ./pkg/provisioner/... ./services/provisioner-local/... ./services/provisioner-sim/... ./services/provisioner-proxmox/... ./services/provisioner-kvm/... ./services/provisioner-gcp/... ./services/provisioner-kubernetes/...
	go vet -tags e2e,cluster ./tests/e2e/
	go vet -tags images ./tests/e2e/images/
	$(BUF) lint
	$(BUF) format --diff --exit-code proto
	for f in $(CHART_VALUES); do $(HELM) lint $(CHART) -f $$f || exit 1; \
		$(HELM) template smoke $(CHART) -f $$f >/dev/null || exit 1; done

## breaking: fail when proto/ breaks wire or JSON compatibility with the baseline
breaking: tools third-party
	$(BUF) breaking proto --against '$(BREAKING_AGAINST)'

## api-baseline: accept the current contracts as the new compatibility baseline
api-baseline: tools third-party
	$(BUF) build proto --exclude-source-info -o $(API_BASELINE)

## build: every service binary and egressctl into bin/
build:
	@mkdir -p bin
	go build -o bin/ $(addprefix ./services/,$(SERVICES)) ./cmd/egressctl

## test: unit and integration tests with the race detector; starts or installs PostgreSQL and squid unless EGRESS_TEST_DATABASE_URL is set
test:
	@[ -n "$$EGRESS_TEST_DATABASE_URL" ] || scripts/ensure-deps.sh
	go test $(GO_TEST_FLAGS) $(MODULE)/...

## bench-scale: the scale figures (orchestrator converge, steady CPU and Ready on health verdicts, lease selection and closed loop against pgbench, health CPU per probe), printed; see docs/benchmarks/scale.md. Never part of `make test`
bench-scale:
	scripts/bench-scale.sh

## test-e2e: every service as a real process over real PostgreSQL and NATS (needs squid or uses the built-in proxy)
test-e2e:
	go test -tags e2e -count=1 -timeout 20m ./tests/e2e/

## bench-gateway: the gateway against the same load sent straight to one upstream, alternating, over a local farm of forward proxies and the real lease service (needs PostgreSQL at 127.0.0.1:5432 or EGRESS_TEST_DATABASE_URL; NATS runs in-process) (docs/benchmarks/gateway.md); BENCH_DURATION (5s), BENCH_WARMUP (1s), BENCH_CONCURRENCY ("1 16 64"), BENCH_SESSIONS (1000), BENCH_PROFILE_DIR (CPU and heap profiles of the gateway), BENCH_PEER (peers over the same farm, beside the gateway: unset, every one installed — Squid when squid is on PATH or at /usr/sbin/squid, glider when glider is on PATH; or a list of squid and glider; none: no peer), BENCH_GATEWAY_ENV (KEY=VALUE settings for the gateway alone, after the chart's GOMAXPROCS=1)
bench-gateway:
	set -o pipefail; cd services/gateway && go test -tags bench -count=1 -timeout 60m -v -run '^TestGatewayBench$$' ./bench/ | grep -v '^{'

## console-screenshots: run the console's browser test against the real suite, writing each page's screenshot to docs/console/ (and printing the Proxies page benchmark)
console-screenshots:
	set -o pipefail; EGRESS_CONSOLE_SCREENSHOTS=$(CURDIR)/docs/console go test -tags e2e -count=1 -timeout 20m -v -run '^TestConsole$$' ./tests/e2e/ | grep -E 'Proxies page|^(ok|FAIL|---)'

## images: one image per service and egressctl, egress-proxies/<name>:$(VERSION), saved as OCI archives in bin/images/
images:
	scripts/images.sh $(VERSION) $(IMAGES)

## test-images: run every image with podman (built by `make images`)
test-images:
	EGRESS_IMAGES="$(IMAGES)" EGRESS_IMAGE_VERSION=$(VERSION) go test -tags images -count=1 -timeout 20m ./tests/e2e/images/

## k8s-tools: build (or reuse) kube-apiserver, controller-manager, scheduler, kubectl, kwok, etcd and helm
k8s-tools:
	scripts/k8s-tools.sh

## test-cluster: against a real API server with kwok nodes (builds the Kubernetes binaries once, cached): the chart installed, provisioner-kubernetes, and the orchestrator with provisioner-kubernetes as processes
test-cluster:
	set -o pipefail; bin=$$(scripts/k8s-tools.sh | tail -1) && export EGRESS_K8S_BIN=$$bin && \
	go test -tags cluster -count=1 -timeout 30m -v ./tests/chart/cluster/ && \
	go test -race -tags cluster -count=1 -timeout 20m -v -run 'TestAgainstAPIServer|TestConformance' ./services/provisioner-kubernetes/ ./services/provisioner-kubernetes/internal/kubernetes/ && \
	go test -tags e2e,cluster -count=1 -timeout 20m -v -run TestKubernetesBackend ./tests/e2e/

## run: build what it starts (and egressctl), then start the suite on this machine; Ctrl-C stops it
run:
	@mkdir -p bin
	go build -o bin/ $(addprefix ./services/,$(RUN_SERVICES)) ./cmd/egressctl
	scripts/run-local.sh $(RUN_SERVICES)

clean:
	rm -rf bin third_party
