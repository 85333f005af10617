package errclass

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

func TestOf(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		err  error
		want Class
	}{
		{"nil has no class", nil, 0},
		{"unclassified is transient", errors.New("boom"), Transient},
		{"classified", New(Permanent, "no such template"), Permanent},
		{"wrapped in fmt", fmt.Errorf("create: %w", New(NotFound, "gone")), NotFound},
		{"joined takes the first classified", errors.Join(errors.New("x"), New(QuotaExceeded, "quota")), QuotaExceeded},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := Of(tc.err); got != tc.want {
				t.Errorf("Of() = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestStatusRoundTrip(t *testing.T) {
	t.Parallel()
	for _, class := range []Class{NotFound, Permanent, Transient, QuotaExceeded, Unsupported} {
		t.Run(class.String(), func(t *testing.T) {
			t.Parallel()
			orig := New(class, "vm 101: %s", class).WithMetadata("vmid", "101")
			st := ToStatus(fmt.Errorf("outer: %w", orig))
			if st.Code() != codeFor(class) {
				t.Errorf("code = %v, want %v", st.Code(), codeFor(class))
			}
			var info *errdetails.ErrorInfo
			for _, d := range st.Details() {
				if i, ok := d.(*errdetails.ErrorInfo); ok {
					info = i
				}
			}
			if info == nil || info.GetReason() != class.String() || info.GetDomain() != Domain {
				t.Fatalf("ErrorInfo = %v, want reason %s in %s", info, class, Domain)
			}
			back := FromStatus(st.Err())
			if Of(back) != class {
				t.Errorf("class after round trip = %v, want %v", Of(back), class)
			}
			var e *Error
			if !errors.As(back, &e) || e.Metadata["vmid"] != "101" {
				t.Errorf("metadata lost: %#v", back)
			}
			if back.Error() != "outer: vm 101: "+class.String() {
				t.Errorf("message = %q", back.Error())
			}
		})
	}
}

// TestToStatusContext: context errors keep their codes when nobody
// classified them, a classified one (a request that ran out of its
// per-request budget, Transient) takes its class's code, and every one
// carries its reason.
func TestToStatusContext(t *testing.T) {
	t.Parallel()
	timedOut := fmt.Errorf("GET /nodes/pv1-1/qemu/101/config: %w", context.DeadlineExceeded)
	cases := []struct {
		name      string
		err       error
		code      codes.Code
		class     Class
		isContext error
	}{
		{"canceled", fmt.Errorf("wait: %w", context.Canceled), codes.Canceled, Transient, context.Canceled},
		{"deadline", context.DeadlineExceeded, codes.DeadlineExceeded, Transient, context.DeadlineExceeded},
		{"per-request timeout classified transient", &Error{Class: Transient, Message: timedOut.Error(), Err: timedOut}, codes.Unavailable, Transient, nil},
		{"permanent wrapping a deadline", Wrap(Permanent, timedOut), codes.FailedPrecondition, Permanent, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := ToStatus(tc.err)
			if st.Code() != tc.code {
				t.Errorf("code = %v, want %v", st.Code(), tc.code)
			}
			var info *errdetails.ErrorInfo
			for _, d := range st.Details() {
				if i, ok := d.(*errdetails.ErrorInfo); ok {
					info = i
				}
			}
			if info == nil || info.GetReason() != tc.class.String() || info.GetDomain() != Domain {
				t.Fatalf("ErrorInfo = %v, want reason %s", info, tc.class)
			}
			back := FromStatus(st.Err())
			if Of(back) != tc.class {
				t.Errorf("class after the round trip = %v, want %v", Of(back), tc.class)
			}
			if tc.isContext != nil && !errors.Is(back, tc.isContext) {
				t.Errorf("%v no longer matches %v", back, tc.isContext)
			}
			if wire := ToCommandError(tc.err); wire.GetReason() != tc.class {
				t.Errorf("NATS reason = %v, want %v", wire.GetReason(), tc.class)
			}
		})
	}
	if !errors.Is(FromStatus(status.Error(codes.DeadlineExceeded, "slow")), context.DeadlineExceeded) {
		t.Error("DeadlineExceeded status did not become context.DeadlineExceeded")
	}
}

func TestFromStatusWithoutErrorInfo(t *testing.T) {
	t.Parallel()
	cases := map[codes.Code]Class{
		codes.NotFound:           NotFound,
		codes.ResourceExhausted:  QuotaExceeded,
		codes.Unimplemented:      Unsupported,
		codes.FailedPrecondition: Permanent,
		codes.PermissionDenied:   Permanent,
		codes.Unavailable:        Transient,
		codes.Internal:           Transient,
	}
	for code, want := range cases {
		if got := Of(FromStatus(status.Error(code, "x"))); got != want {
			t.Errorf("%v → %v, want %v", code, got, want)
		}
	}
	if Of(FromStatus(errors.New("not a status"))) != Transient {
		t.Error("a non-status error must be transient")
	}
}

func TestCommandErrorRoundTrip(t *testing.T) {
	t.Parallel()
	orig := New(Permanent, "template 9001 is not a template").WithMetadata("template", "9001")
	ce := ToCommandError(orig)
	wire, err := proto.Marshal(ce)
	if err != nil {
		t.Fatal(err)
	}
	decoded := new(busv1.CommandError)
	if err := proto.Unmarshal(wire, decoded); err != nil {
		t.Fatal(err)
	}
	back := FromCommandError(decoded)
	if Of(back) != Permanent || back.Error() != orig.Error() {
		t.Errorf("round trip = %v (%v)", back, Of(back))
	}
	if ToCommandError(nil) != nil || FromCommandError(nil) != nil {
		t.Error("nil must stay nil")
	}
	if got := ToCommandError(errors.New("unclassified")).GetReason(); got != Transient {
		t.Errorf("unclassified reason = %v, want Transient", got)
	}
}

// A backend's error text is copied into the status and the command result
// as it came: an invalid UTF-8 sequence in it must not make either fail to
// encode, nor lose the class.
func TestInvalidUTF8StillEncodes(t *testing.T) {
	t.Parallel()
	err := New(Permanent, "disk \xff\xfe full").WithMetadata("volume", "vol\xff1")
	wire, merr := proto.Marshal(ToCommandError(err))
	if merr != nil {
		t.Fatalf("command error: %v", merr)
	}
	decoded := new(busv1.CommandError)
	if err := proto.Unmarshal(wire, decoded); err != nil {
		t.Fatal(err)
	}
	if back := FromCommandError(decoded); Of(back) != Permanent || !strings.Contains(back.Error(), "full") {
		t.Errorf("command error round trip = %v (%v)", back, Of(back))
	}
	if _, merr := proto.Marshal(ToStatus(err).Proto()); merr != nil {
		t.Errorf("status: %v", merr)
	}
	if back := FromStatus(ToStatus(err).Err()); Of(back) != Permanent {
		t.Errorf("status round trip = %v (%v), want Permanent", back, Of(back))
	}
}
