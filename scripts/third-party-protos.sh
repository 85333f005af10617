#!/usr/bin/env bash
# Copies the third-party protos the contracts import into third_party/, from
# Go modules at pinned versions (the buf registry cannot be reached here):
#   google/api/{annotations,http}.proto  from grpc-gateway v1.16.0's googleapis copy
#   protoc-gen-openapiv2/options/*.proto from grpc-gateway/v2, as pinned in tools/go.mod
#   buf/validate/validate.proto          from github.com/bufbuild/protovalidate (the rules
#                                        the buf.build/go/protovalidate runtime enforces)
set -euo pipefail
cd "$(dirname "$0")/.."

googleapis_mod=github.com/grpc-ecosystem/grpc-gateway@v1.16.0
protovalidate_mod=github.com/bufbuild/protovalidate@v1.2.2
v1_dir=$(cd tools && GOWORK=off GOFLAGS=-mod=mod go mod download -json "$googleapis_mod" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
(cd tools && GOWORK=off go mod download github.com/grpc-ecosystem/grpc-gateway/v2)
v2_dir=$(cd tools && GOWORK=off go list -m -f '{{.Dir}}' github.com/grpc-ecosystem/grpc-gateway/v2)
pv_dir=$(cd tools && GOWORK=off GOFLAGS=-mod=mod go mod download -json "$protovalidate_mod" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
if [ -z "$v1_dir" ] || [ -z "$v2_dir" ] || [ -z "$pv_dir" ]; then
	echo "third-party-protos: could not locate the grpc-gateway or protovalidate modules" >&2
	exit 1
fi

rm -rf third_party
mkdir -p third_party/google/api third_party/protoc-gen-openapiv2/options third_party/buf/validate
cp "$v1_dir"/third_party/googleapis/google/api/{annotations,http}.proto third_party/google/api/
cp "$v2_dir"/protoc-gen-openapiv2/options/{annotations,openapiv2}.proto third_party/protoc-gen-openapiv2/options/
cp "$pv_dir"/proto/protovalidate/buf/validate/validate.proto third_party/buf/validate/
chmod -R u+w third_party
