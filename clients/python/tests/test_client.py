"""The lease lifecycle over REST against a running suite."""

import datetime
import socket
import threading
import time

import pytest

from conftest import LEASE_URL, TOKEN, only
from egress_proxies import (
    BANNED,
    SCOPE_GLOBAL,
    TIMEOUT,
    Backoff,
    LeaseClient,
    LeaseError,
    LeaseLost,
    LeaseReleased,
    NoProxyAvailable,
)

pytestmark = pytest.mark.suite


def wait_until(what, timeout, cond):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        time.sleep(0.05)  # polling interval


def active_leases(client, proxy_name):
    for p in client.list_proxies():
        if p["proxyName"] == proxy_name:
            return p.get("activeLeases", 0)
    raise AssertionError(f"{proxy_name} is not leasable")


def test_renewals_keep_the_lease_past_its_ttl(client):
    lease = client.acquire("renew.example", ttl=5)
    first = lease.expire_time
    # The suite sweeps expired leases every second: an expiry 7s past the
    # first one means the lease outlived its TTL by renewals alone.
    wait_until("renewals moved the expiry 7s on", 20,
               lambda: lease.expire_time - first > datetime.timedelta(seconds=7))
    assert lease.active and lease.error is None
    assert active_leases(client, lease.proxy_name) == 1
    assert lease.release() is True
    assert not lease.active and isinstance(lease.error, LeaseReleased)
    assert active_leases(client, lease.proxy_name) == 0
    assert lease.release() is True  # idempotent


def test_lost_lease_is_reported(client):
    lost = []
    got = threading.Event()
    c = LeaseClient(LEASE_URL, TOKEN, on_lost=lambda lease, err: (lost.append(err), got.set()))
    try:
        lease = c.acquire("lost.example", ttl=6)
        client._call("POST", f"/v1/leases/{lease.id}:release", {})  # ended elsewhere
        assert got.wait(10), "on_lost not called in 10s"
        err = lost[0]
        assert isinstance(err, LeaseLost) and err.lease_id == lease.id and err.code == 5 and not err.expired
        assert lease.ended.is_set() and lease.error is err
        assert lease.release() is True
    finally:
        c.close()


def test_release_on_every_exit_path(client, proxy_ids):
    target = only(proxy_ids[0])
    with pytest.raises(RuntimeError):
        with client.acquire("exit.example", target, ttl=30) as lease:
            raise RuntimeError("parser bug")
    assert not lease.active
    assert active_leases(client, lease.proxy_name) == 0

    c = LeaseClient(LEASE_URL, TOKEN)
    held = c.acquire("exit.example", target, ttl=30)
    assert active_leases(client, held.proxy_name) == 1
    c.close()
    assert isinstance(held.error, LeaseReleased)
    assert active_leases(client, held.proxy_name) == 0


def test_ban_cools_the_proxy_down_for_its_target(client):
    lease = client.acquire("shop.example", ttl=30)
    cd = lease.report(BANNED)
    lease.release()
    assert cd.target_host == "shop.example" and cd.outcome == BANNED
    left = (cd.expire_time - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    assert 3500 < left <= 3600
    for _ in range(3):
        with client.acquire("shop.example", ttl=30) as other:
            assert other.proxy_name != lease.proxy_name
    banned = next(p for p in client.list_proxies() if p["proxyName"] == lease.proxy_name)
    with client.try_acquire("news.example", only(banned["labels"]["id"]), ttl=30) as same:
        assert same.proxy_name == lease.proxy_name


def test_global_scope_keeps_the_proxy_from_every_target(client, proxy_ids):
    with client.acquire("slow.example", only(proxy_ids[1]), ttl=30) as lease:
        cd = lease.report(TIMEOUT, cooldown=3, scope=SCOPE_GLOBAL)
    assert cd.target_host == "" and cd.outcome == TIMEOUT
    with pytest.raises(NoProxyAvailable) as e:
        client.try_acquire("elsewhere.example", only(proxy_ids[1]), ttl=30)
    assert e.value.http_status == 409 and e.value.matching == 1 and e.value.cooling_down_global == 1


class CountingBackoff(Backoff):
    def __init__(self):
        super().__init__(initial=0.05, maximum=0.2)
        self.count = 0

    def waits(self):
        for w in super().waits():
            self.count += 1
            yield w


def test_acquire_waits_with_backoff_while_no_proxy_is_free(client, proxy_ids):
    target = only(proxy_ids[2])
    holder = client.acquire("wait.example", target, ttl=30)
    backoff = CountingBackoff()
    waiter = LeaseClient(LEASE_URL, TOKEN, backoff=backoff)
    result = {}
    t = threading.Thread(target=lambda: result.update(lease=waiter.acquire("wait.example", target, ttl=30, max_wait=30)))
    t.start()
    try:
        wait_until("the waiter retried twice", 10, lambda: backoff.count >= 3)
        assert "lease" not in result
        holder.release()
        t.join(10)
        assert result["lease"].proxy_name == holder.proxy_name
        result["lease"].release()

        holder = client.acquire("wait.example", target, ttl=30)
        start = time.monotonic()
        with pytest.raises(NoProxyAvailable) as e:
            waiter.acquire("wait.example", target, ttl=30, max_wait=1.5)
        took = time.monotonic() - start
        assert 1.4 < took < 5 and e.value.at_capacity == 1
    finally:
        holder.release()
        waiter.close()


def test_bad_input_names_the_field(client):
    with pytest.raises(ValueError, match="base_url"):
        LeaseClient("", TOKEN)
    with pytest.raises(LeaseError, match="ttl") as e:
        client.try_acquire("x.example", ttl=1)
    assert e.value.code == 3 and e.value.http_status == 400
    with client.acquire("x.example", ttl=30) as lease:
        with pytest.raises(ValueError, match="outcome"):
            lease.report("OUTCOME_NOPE")
    with pytest.raises(LeaseError) as e:
        LeaseClient(LEASE_URL, "not-a-token").list_proxies()
    assert e.value.http_status == 401 and "not-a-token" not in str(e.value)


def test_unreachable_service_past_the_expiry_loses_the_lease():
    lost = threading.Event()
    c = LeaseClient(LEASE_URL, TOKEN, timeout=1, on_lost=lambda lease, err: lost.set())
    lease = c.acquire("partition.example", ttl=5)
    # A port nothing listens on: every renewal is refused from now on.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    c.base_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    assert lost.wait(15), "the lease was not reported lost in 15s"
    assert isinstance(lease.error, LeaseLost) and lease.error.expired and lease.error.code == 14
    assert datetime.datetime.now(datetime.timezone.utc) >= lease.expire_time
    c.base_url = LEASE_URL
    lease.release()  # the failed release of the loss is remembered: no new call
