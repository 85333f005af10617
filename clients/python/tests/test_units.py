"""Parts of the client that need no suite."""

import datetime
import random
import string

import pytest

from egress_proxies.client import Backoff, LeaseError, _duration, _parse_time


@pytest.mark.parametrize("text,want", [
    ("2026-12-02T14:29:01Z", datetime.datetime(2026, 12, 2, 14, 29, 1, tzinfo=datetime.timezone.utc)),
    ("2026-12-02T14:29:01.5Z", datetime.datetime(2026, 12, 2, 14, 29, 1, 500000, tzinfo=datetime.timezone.utc)),
    ("2026-12-02T14:29:01.266593775Z", datetime.datetime(2026, 12, 2, 14, 29, 1, 266593, tzinfo=datetime.timezone.utc)),
    ("2026-12-02T16:29:01.5+02:00", datetime.datetime(2026, 12, 2, 14, 29, 1, 500000, tzinfo=datetime.timezone.utc)),
])
def test_parse_time(text, want):
    assert _parse_time(text) == want


def test_parse_time_rejects_garbage_with_lease_error():
    rng = random.Random(22)
    alphabet = string.digits + "-:.TZz+ x"
    samples = ["", "2026-12-02", "2026-12-02T14:29:01", "2026-13-02T14:29:01Z", "2026-12-02T14:29:61Z"]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(5000)]
    for text in samples:
        try:
            got = _parse_time(text)
        except LeaseError:
            continue
        except ValueError as e:  # fromisoformat on a well-formed but impossible date
            pytest.fail(f"{text!r}: {e!r} escaped as ValueError")
        assert got.tzinfo is not None


@pytest.mark.parametrize("seconds,want", [(120, "120s"), (1.5, "1.5s"), (0, "0s"), (0.25, "0.25s")])
def test_duration(seconds, want):
    assert _duration(seconds) == want


def test_backoff_grows_to_its_cap_with_jitter():
    waits = Backoff(initial=1, multiplier=2, maximum=8, jitter=0.5).waits()
    got = [next(waits) for _ in range(8)]
    for w, base in zip(got, [1, 2, 4, 8, 8, 8, 8, 8]):
        assert base * 0.5 <= w <= base * 1.5
    assert len(set(got)) > 1


def test_lease_proxy_url_carries_the_credentials_of_the_answer():
    from egress_proxies.client import Lease

    data = {"leaseId": "l1", "address": {"host": "127.0.0.5", "port": 3128, "scheme": "http"},
            "acquireTime": "2026-12-02T17:31:20Z", "expireTime": "2026-12-02T17:36:20Z"}
    with_creds = Lease(None, data, None, {"username": "egress-0123456789ab", "password": "p/w:x"})
    assert with_creds.proxy_url == "http://egress-0123456789ab:p%2Fw%3Ax@127.0.0.5:3128"
    assert "p%2Fw" not in repr(with_creds)
    assert Lease(None, data, None, None).proxy_url == "http://127.0.0.5:3128"
