module github.com/egress-proxies/egress-proxies/examples/crawler

go 1.26.0

require (
	github.com/egress-proxies/egress-proxies/clients/go v0.0.0
	golang.org/x/net v0.62.0
)

require (
	buf.build/gen/go/bufbuild/protovalidate/protocolbuffers/go v1.36.12-20260825204119-511051f7f437.1 // indirect
	github.com/cenkalti/backoff/v5 v5.0.3 // indirect
	github.com/egress-proxies/egress-proxies/pkg/api v0.0.0 // indirect
	github.com/grpc-ecosystem/grpc-gateway/v2 v2.34.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
	golang.org/x/text v0.44.0 // indirect
	google.golang.org/genproto/googleapis/api v0.0.0-20261110000943-09e21b237f2c // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20261110000943-09e21b237f2c // indirect
	google.golang.org/grpc v1.85.0 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)

replace (
	github.com/egress-proxies/egress-proxies/clients/go => ../../clients/go
	github.com/egress-proxies/egress-proxies/pkg/api => ../../pkg/api
)
