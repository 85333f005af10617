"""The Scrapy middleware's decisions that need no network."""

import base64
import re

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


# -- gateway mode -------------------------------------------------------------

from egress_proxies import GatewayClient, gateway_proxy_url, gateway_username  # noqa: E402
from egress_proxies.scrapy import EgressGatewayMiddleware  # noqa: E402


def basic(request):
    value = request.headers.get("Proxy-Authorization", b"").decode()
    assert value.startswith("Basic "), value
    return base64.b64decode(value[len("Basic "):]).decode()


class FakeSpider:
    name = "shop spider"


def gateway(**kw):
    kw.setdefault("session_prefix", "run1.")
    return EgressGatewayMiddleware("http://127.0.0.1:8080", "tok en", **kw)


def test_username_carries_every_option_in_the_gateways_grammar():
    assert gateway_username() == ""
    assert gateway_username(session="cart42", pool="web", lifetime=600,
                            selector={"provider": "gce", "region": "europe-west1", "zone": "europe-west1-b",
                                      "labels": {"market": "eu", "example.com/tier": ""}}) == \
        "session-cart42,pool-web,provider-gce,region-europe-west1,zone-europe-west1-b," \
        "label-example.com/tier=,label-market=eu,lifetime-600s"


@pytest.mark.parametrize("kw,field", [
    ({"session": "a,b"}, "session"),
    ({"session": ""}, "session"),
    ({"session": "x" * 65}, "session"),
    ({"pool": "web,session-x"}, "pool"),
    ({"selector": {"region": "eu west"}}, "selector.region"),
    ({"selector": {"labels": {"a=b": "c"}}}, "selector.labels key"),
    ({"selector": {"labels": {"a": "b,c"}}}, "selector.labels['a']"),
    ({"lifetime": 60}, "lifetime"),
    ({"session": "s", "lifetime": 0}, "lifetime"),
])
def test_username_refuses_what_would_break_it_naming_the_option(kw, field):
    with pytest.raises(ValueError) as e:
        gateway_username(**kw)
    assert str(e.value).startswith(field), e.value


def test_proxy_url_quotes_the_token_and_refuses_other_urls():
    assert gateway_proxy_url("http://gw:8080", "t/k:n", session="s1") == "http://session-s1:t%2Fk%3An@gw:8080"
    assert gateway_proxy_url("http://gw:8080/", "t") == "http://:t@gw:8080"
    for bad in ("https://gw:8080", "gw:8080", "http://u:p@gw:8080", "http://gw:8080/path"):
        with pytest.raises(ValueError) as e:
            gateway_proxy_url(bad, "secret-token")
        assert "secret-token" not in str(e.value) and ":p@" not in str(e.value)


def test_gateway_report_needs_exactly_one_of_session_and_lease():
    c = GatewayClient("http://127.0.0.1:9", "t")
    with pytest.raises(ValueError):
        c.report(BANNED, "shop.example")
    with pytest.raises(ValueError):
        c.report(BANNED, "shop.example", session_id="s", lease_id="l")
    with pytest.raises(ValueError):
        c.report("OUTCOME_SUCCESS", "shop.example", session_id="s")
    assert "'t'" not in repr(c)


def test_gateway_sessions_per_domain_spider_or_none():
    req = Request("http://Shop.Example./p/1")
    mw = gateway()
    assert mw.process_request(req, FakeSpider()) is None
    assert req.meta["proxy"] == "http://127.0.0.1:8080"
    assert basic(req) == "session-run1.shop.example:tok en"
    assert req.meta["egress_session"] == "run1.shop.example"

    spider_req = Request("http://other.example/")
    gateway(session_mode="spider").process_request(spider_req, FakeSpider())
    # "shop spider" holds a space: the session id is a digest of it.
    assert re.fullmatch(r"run1\.[0-9a-f]{24}", spider_req.meta["egress_session"]), spider_req.meta

    rot = Request("http://shop.example/")
    gateway(session_mode="none", pool="web").process_request(rot, FakeSpider())
    assert basic(rot) == "pool-web:tok en" and rot.meta["egress_session"] is None
    # No option at all: the token still goes (Scrapy would send none from
    # a proxy URL with an empty username).
    bare = Request("http://shop.example/")
    gateway(session_mode="none").process_request(bare, FakeSpider())
    assert basic(bare) == ":tok en" and bare.meta["proxy"] == "http://127.0.0.1:8080"

    # Each crawl gets sessions of its own unless told otherwise.
    a = EgressGatewayMiddleware("http://127.0.0.1:8080", "t")
    b = EgressGatewayMiddleware("http://127.0.0.1:8080", "t")
    assert a.session_id_for("x.example", "s") != b.session_id_for("x.example", "s")


def test_gateway_mode_refuses_bad_settings_at_start():
    with pytest.raises(ValueError, match="EGRESS_GATEWAY_SESSION"):
        gateway(session_mode="per-request")
    with pytest.raises(ValueError, match="pool"):
        gateway(pool="a,b")
    from scrapy.exceptions import NotConfigured
    from scrapy.utils.test import get_crawler
    with pytest.raises(NotConfigured):
        EgressGatewayMiddleware.from_crawler(get_crawler(settings_dict={}))


def test_gateway_mode_leaves_foreign_proxies_and_passes_successes():
    mw = gateway()
    mine = Request("http://shop.example/", meta={"proxy": "http://mine:3128"})
    assert mw.process_request(mine, FakeSpider()) is None and mine.meta["proxy"] == "http://mine:3128"
    r = response(200)
    mw.process_request(r.request, FakeSpider())
    assert mw.process_response(r.request, r, FakeSpider()) is r
