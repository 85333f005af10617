// Package validatetest helps fuzz tests feed requests the way clients send
// them and recognise the suite's validation errors.
package validatetest

import (
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/egress-proxies/egress-proxies/pkg/rest"
)

// Decode fills m from data as gRPC (protobuf binary) or the REST layer
// (JSON, asJSON) decodes a request; false when they would refuse it before
// any validation.
func Decode(data []byte, asJSON bool, m proto.Message) bool {
	if asJSON {
		return rest.Marshaler().Unmarshal(data, m) == nil
	}
	return proto.Unmarshal(data, m) == nil
}

// IsViolation reports whether err has the shape of every validation error:
// INVALID_ARGUMENT whose message starts "invalid request: ".
func IsViolation(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "rpc error: code = InvalidArgument desc = invalid request: ")
}
