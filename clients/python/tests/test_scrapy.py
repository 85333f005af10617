"""The Scrapy middleware crawling a local site through the suite's proxies,
with bans injected by the site."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import LEASE_URL, TOKEN, Site

pytestmark = pytest.mark.suite


def test_scrapy_crawl_moves_past_bans(client, tmp_path):
    # 9 pages in 12 requests: the 5th and 10th are answered 403, the 7th
    # with a 200 "Access denied" page that the spider's hook reports.
    def answer(n, path):
        if n % 5 == 0:
            return 403, "Forbidden"
        if n == 7:
            return 200, "<html><h1>Access denied</h1></html>"
        return None

    site = Site(pages=8, answer=answer)
    out = tmp_path / "crawl.json"
    try:
        env = dict(os.environ, EGRESS_LEASE_URL=LEASE_URL, EGRESS_TOKEN=TOKEN,
                   PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "crawl_site.py"), site.url + "/", str(out)],
                             env=env, capture_output=True, text=True, timeout=180)
    finally:
        site.close()
    log = (tmp_path / "crawl.json.log").read_text() if (tmp_path / "crawl.json.log").exists() else ""
    assert run.returncode == 0, run.stderr + log
    result = json.loads(out.read_text())
    items, stats = result["items"], result["stats"]

    # Every page crawled, each through a leased proxy.
    assert sorted(i["url"].split("127.0.0.1:")[1].split("/", 1)[1] for i in items) == [""] + [f"p/{k}" for k in range(8)], items
    assert all(i["status"] == 200 and i["proxy"] and i["lease"] for i in items), items
    assert [s for _, _, s in site.log].count(403) == 2
    assert stats.get("egress/bans/OUTCOME_BLOCKED") == 2 and stats.get("egress/bans/OUTCOME_BANNED") == 1, stats

    # Each ban met on a proxy: the page was fetched again through another
    # one, and the service keeps that proxy away from the site.
    bans = re.findall(r"ban on (\S+) through (\S+): (OUTCOME_\w+)", log)
    assert len(bans) == 3, log
    fetched_via = {i["url"]: i["proxy"] for i in items}
    cooling = {p["proxyName"]: {c.get("targetHost", ""): c["outcome"] for c in p.get("cooldowns", [])}
               for p in client.list_proxies()}
    for url, proxy, outcome in bans:
        assert fetched_via[url] != proxy, (url, proxy, items)
        assert "127.0.0.1" in cooling[proxy], (proxy, cooling)

    # The spider released every lease when it closed.
    assert all(p.get("activeLeases", 0) == 0 for p in client.list_proxies())


def test_idle_domain_lease_is_released(client):
    from scrapy.http import Request

    from egress_proxies.scrapy import EgressProxyMiddleware

    mw = EgressProxyMiddleware(client, idle_release=60)
    lease = mw._lease_for("idle.example")
    req = Request("http://idle.example/page")
    mw._apply(req, lease)
    later = time.monotonic() + 120
    assert mw.idle_leases(later) == []  # a request in flight
    mw._end(req)
    idle = mw.idle_leases(time.monotonic() + 120)
    assert idle == [lease]
    for each in idle:
        each.release()
    active = {p["proxyName"]: p.get("activeLeases", 0) for p in client.list_proxies()}
    assert active[lease.proxy_name] == 0
    again = mw._lease_for("idle.example")
    assert again is not lease and again.active
    mw.release_all()
    assert not again.active
