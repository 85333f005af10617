"""The Scrapy middleware in gateway mode, crawling a local site through a
running gateway: one proxy per domain as a session, a ban reported through
the gateway's admin API moving the session, the sessions ended at close."""

import json
import os
import subprocess
import sys

import pytest

from conftest import GATEWAY_ADMIN_URL, GATEWAY_URL, TOKEN, Site
from egress_proxies import GatewayClient

pytestmark = pytest.mark.gateway


def test_scrapy_through_the_gateway_keeps_a_domain_on_one_proxy_until_a_ban(tmp_path):
    # 8 pages; the 4th request is answered 429, which only the middleware
    # (not the gateway's rules) sees as a ban.
    site = Site(pages=8, answer=lambda n, path: (429, "Too Many Requests") if n == 4 else None)
    out = tmp_path / "crawl.json"
    try:
        env = dict(os.environ, EGRESS_GATEWAY_URL=GATEWAY_URL, EGRESS_GATEWAY_ADMIN_URL=GATEWAY_ADMIN_URL,
                   EGRESS_TOKEN=TOKEN,
                   PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "crawl_site.py"),
                              site.url + "/", str(out), "gateway"],
                             env=env, capture_output=True, text=True, timeout=180)
    finally:
        site.close()
    log = (tmp_path / "crawl.json.log").read_text() if (tmp_path / "crawl.json.log").exists() else ""
    assert run.returncode == 0, run.stderr + log
    assert TOKEN not in log, "the crawler token reached Scrapy's log"
    result = json.loads(out.read_text())
    items, stats = result["items"], result["stats"]

    # Every page crawled through the gateway, in one session of the domain.
    assert sorted(i["url"].split("127.0.0.1:")[1].split("/", 1)[1] for i in items) == [""] + [f"p/{k}" for k in range(8)], items
    assert all(i["status"] == 200 and i["proxy"] and i["lease"] for i in items), items
    sessions = {i["session"] for i in items}
    assert len(sessions) == 1 and sessions.pop().endswith(".127.0.0.1"), items
    assert [s for _, _, s in site.log].count(429) == 1
    assert stats.get("egress/bans/OUTCOME_BANNED") == 1, stats

    # One proxy before the ban, another after it; the move is shown on the
    # first answer through the new proxy.
    proxies = [i["proxy"] for i in items]
    changes = [k for k in range(1, len(proxies)) if proxies[k] != proxies[k - 1]]
    assert len(changes) == 1, proxies
    moved = items[changes[0]]["moved"]
    assert moved.startswith(proxies[0] + ";") and "reason=" in moved, items[changes[0]]
    assert not any(i["moved"] for k, i in enumerate(items) if k != changes[0]), items

    # The middleware ended the session when the spider closed: it holds no
    # lease any more.
    session = items[0]["session"]
    assert GatewayClient(GATEWAY_ADMIN_URL, TOKEN).end_session(session) is False
