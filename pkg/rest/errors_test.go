package rest_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/egress-proxies/egress-proxies/pkg/rest"
)

type answer struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	Details []struct {
		Type            string `json:"@type"`
		FieldViolations []struct {
			Field string `json:"field"`
		} `json:"fieldViolations"`
	} `json:"details"`
}

func handle(t *testing.T, h func(context.Context, http.ResponseWriter, *http.Request)) (int, answer) {
	t.Helper()
	rec := httptest.NewRecorder()
	h(context.Background(), rec, httptest.NewRequest("GET", "/v1/x", nil))
	var a answer
	if err := json.Unmarshal(rec.Body.Bytes(), &a); err != nil {
		t.Fatalf("not JSON: %s", rec.Body)
	}
	return rec.Code, a
}

func field(a answer) string {
	for _, d := range a.Details {
		if d.Type == "type.googleapis.com/google.rpc.BadRequest" && len(d.FieldViolations) == 1 {
			return d.FieldViolations[0].Field
		}
	}
	return ""
}

func TestErrorHandlerNamesDecodeFields(t *testing.T) {
	t.Parallel()
	mux := rest.NewServeMux()
	for msg, want := range map[string]string{
		`parsing field "page_size": strconv.ParseInt: parsing "x": invalid syntax`: "page_size",
		`type mismatch, parameter: lease_id, error: x`:                             "lease_id",
		`missing parameter name`:                                                   "name",
		`proto: (line 1:27): unknown field "colour"`:                               "colour",
		`proto: (line 1:9): invalid value for uint32 field port: 5000000000`:       "port",
		`proto: syntax error (line 1:8): unexpected token 42`:                      "body",
		`invalid character 'l' looking for beginning of object key string`:         "body",
	} {
		code, a := handle(t, func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
			rest.ErrorHandler(ctx, mux, rest.Marshaler(), w, r, status.Error(codes.InvalidArgument, msg))
		})
		if code != 400 || a.Code != 3 || field(a) != want || a.Message != "invalid request: "+want+": "+msg {
			t.Errorf("%q: %d %+v; want 400 naming %s", msg, code, a, want)
		}
	}
	// A status that already has its details is left alone.
	st, _ := status.New(codes.InvalidArgument, "invalid request: zone: bad").WithDetails(&errdetails.BadRequest{
		FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: "zone", Description: "bad"}}})
	code, a := handle(t, func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
		rest.ErrorHandler(ctx, mux, rest.Marshaler(), w, r, st.Err())
	})
	if code != 400 || field(a) != "zone" || a.Message != "invalid request: zone: bad" {
		t.Errorf("detailed status: %d %+v", code, a)
	}
	// Other codes keep grpc-gateway's mapping.
	code, a = handle(t, func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
		rest.ErrorHandler(ctx, mux, rest.Marshaler(), w, r, status.Error(codes.NotFound, "proxy \"x\" not found"))
	})
	if code != 404 || a.Code != 5 {
		t.Errorf("not found: %d %+v", code, a)
	}
}

func TestErrorHandlerWithOverride(t *testing.T) {
	t.Parallel()
	h := rest.ErrorHandlerWith(func(st *status.Status) int {
		if st.Code() == codes.ResourceExhausted {
			return http.StatusConflict
		}
		return 0
	})
	mux := rest.NewServeMux()
	for c, want := range map[codes.Code]int{codes.ResourceExhausted: 409, codes.Unavailable: 503} {
		code, a := handle(t, func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
			h(ctx, mux, rest.Marshaler(), w, r, status.Error(c, "x"))
		})
		if code != want || a.Code != int(c) {
			t.Errorf("%s: %d %+v; want %d", c, code, a, want)
		}
	}
}

func TestRoutingErrors(t *testing.T) {
	t.Parallel()
	mux := rest.NewServeMux()
	if err := mux.HandlePath("GET", "/v1/things", func(w http.ResponseWriter, _ *http.Request, _ map[string]string) {}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		method, path string
		code, grpc   int
	}{{"DELETE", "/v1/things", 405, 12}, {"GET", "/v1/nothing", 404, 5}} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, nil))
		var a answer
		if err := json.Unmarshal(rec.Body.Bytes(), &a); err != nil || rec.Code != tc.code || a.Code != tc.grpc || a.Message == "" {
			t.Errorf("%s %s = %d %s; want %d with code %d", tc.method, tc.path, rec.Code, rec.Body, tc.code, tc.grpc)
		}
	}
}
