"""The Scrapy middleware's decisions that need no network."""

import pytest

scrapy = pytest.importorskip("scrapy")

from scrapy.http import HtmlResponse, Request  # noqa: E402

from egress_proxies import BANNED, BLOCKED, CAPTCHA, LeaseClient  # noqa: E402
from egress_proxies.scrapy import EgressProxyMiddleware  # noqa: E402


def middleware(**kw):
    return EgressProxyMiddleware(LeaseClient("http://127.0.0.1:9"), **kw)


def response(status, body=b"<html></html>"):
    return HtmlResponse("http://shop.example/p", status=status, body=body, request=Request("http://shop.example/p"))


@pytest.mark.parametrize("status,body,want", [
    (200, b"<h1>catalog</h1>", None),
    (404, b"missing", None),
    (403, b"forbidden", BLOCKED),
    (429, b"slow down", BANNED),
    (200, b"<div class=g-recaptcha>", CAPTCHA),  # the hook's call
])
def test_classify_status_codes_then_hook(status, body, want):
    def hook(request, resp, spider):
        return CAPTCHA if b"recaptcha" in resp.body else None

    mw = middleware(ban_detector=hook)
    r = response(status, body)
    assert mw.classify(r.request, r, None) == want


def test_custom_ban_codes_replace_the_defaults():
    mw = middleware(ban_codes={503: BLOCKED})
    assert mw.classify(None, response(503), None) == BLOCKED
    assert mw.classify(None, response(403), None) is None


def test_requests_with_their_own_proxy_are_left_alone():
    mw = middleware()
    req = Request("http://shop.example/", meta={"proxy": "http://mine:3128"})
    assert mw.process_request(req, None) is None and req.meta["proxy"] == "http://mine:3128"
    skipped = Request("http://shop.example/", meta={"egress_skip": True})
    assert mw.process_request(skipped, None) is None and "proxy" not in skipped.meta


def test_responses_without_a_lease_pass_through():
    mw = middleware()
    r = response(403)
    assert mw.process_response(r.request, r, None) is r


def test_not_configured_without_lease_url():
    from scrapy.exceptions import NotConfigured
    from scrapy.utils.test import get_crawler

    with pytest.raises(NotConfigured):
        EgressProxyMiddleware.from_crawler(get_crawler(settings_dict={}))
    mw = EgressProxyMiddleware.from_crawler(get_crawler(settings_dict={
        "EGRESS_LEASE_URL": "http://lease:8111", "EGRESS_BAN_CODES": {"403": "OUTCOME_BANNED"},
        "EGRESS_SELECTOR": {"labels": {"pool": "eu"}}}))
    assert mw.ban_codes == {403: BANNED} and mw.selector == {"labels": {"pool": "eu"}}


class FakeLease:
    """Stands in for a Lease where only the middleware's bookkeeping is
    under test (no service is reached)."""

    def __init__(self, name):
        self.id = name
        self.proxy_name = name
        self.proxy_url = "http://" + name + ":3128"
        self.target_host = ""
        self.active = True


def test_idle_leases_spare_domains_with_requests_in_flight():
    import time

    mw = middleware(idle_release=60)
    busy, quiet = FakeLease("busy"), FakeLease("quiet")
    mw._held = {"busy.example": busy, "quiet.example": quiet}
    r1, r2 = Request("http://busy.example/a"), Request("http://quiet.example/a")
    mw._apply(r1, busy)
    mw._apply(r2, quiet)
    assert r1.meta["proxy"] == "http://busy:3128"
    mw._end(r2)
    now = time.monotonic()
    assert mw.idle_leases(now + 30) == []
    assert mw.idle_leases(now + 61) == [quiet]
    assert mw._held == {"busy.example": busy}
    mw._end(r1)
    mw._end(r1)  # counted once, however often it ends
    assert mw._inflight["busy.example"] == 0
    assert mw.idle_leases(time.monotonic() + 61) == [busy] and mw._held == {}
