"""Fixtures of the tests against a running suite.

They need the lease service's REST address and a crawler token in
EGRESS_LEASE_URL and EGRESS_TOKEN; `make test-e2e` starts a suite with
proxies and runs them (tests/e2e/clients_test.go). The gateway's tests
need its proxy and admin addresses in EGRESS_GATEWAY_URL and
EGRESS_GATEWAY_ADMIN_URL too (tests/e2e/gateway_test.go runs them).
"""

import http.server
import os
import re
import threading

import pytest

from egress_proxies import LeaseClient

LEASE_URL = os.environ.get("EGRESS_LEASE_URL", "")
TOKEN = os.environ.get("EGRESS_TOKEN", "")
GATEWAY_URL = os.environ.get("EGRESS_GATEWAY_URL", "")
GATEWAY_ADMIN_URL = os.environ.get("EGRESS_GATEWAY_ADMIN_URL", "")



def pytest_configure(config):
    config.addinivalue_line("markers", "suite: needs a running suite (EGRESS_LEASE_URL)")
    config.addinivalue_line("markers", "gateway: needs a running gateway (EGRESS_GATEWAY_URL, EGRESS_GATEWAY_ADMIN_URL)")


def pytest_collection_modifyitems(config, items):
    for marker, ready, why in (("suite", LEASE_URL, "EGRESS_LEASE_URL"),
                               ("gateway", GATEWAY_URL and GATEWAY_ADMIN_URL, "EGRESS_GATEWAY_URL")):
        if ready:
            continue
        skip = pytest.mark.skip(reason=f"{why} is not set: these tests run against a suite (make test-e2e)")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def client():
    c = LeaseClient(LEASE_URL, TOKEN)
    yield c
    c.close()


@pytest.fixture
def proxy_ids(client):
    """The `id` labels of the suite's leasable proxies."""
    return sorted(p["labels"]["id"] for p in client.list_proxies())


def only(proxy_id):
    return {"labels": {"id": proxy_id}}


class Site:
    """A local site of pages / and /p/0 … /p/{pages-1}, each linking to two
    others. ``answer(n, path)`` may replace the answer to the n-th request
    (1-based) with (status, body). Every request is logged as (n, path,
    status)."""

    def __init__(self, pages, answer=None):
        self.pages = pages
        self.answer = answer
        self.log = []
        self._lock = threading.Lock()
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                with site._lock:
                    n = len(site.log) + 1
                    status, body = site.render(n, self.path)
                    site.log.append((n, self.path, status))
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def render(self, n, path):
        if self.answer is not None:
            replaced = self.answer(n, path)
            if replaced is not None:
                return replaced
        m = re.fullmatch(r"/p/(\d+)", path)
        if path != "/" and (m is None or int(m.group(1)) >= self.pages):
            return 404, "not found"
        page = int(m.group(1)) if m else 0
        return 200, (f'<html><body><h1>page {path}</h1><a href="/p/{(page + 1) % self.pages}">next</a> '
                     f'<a href="/p/{(page * 3 + 2) % self.pages}">skip</a></body></html>')

    def close(self):
        self.server.shutdown()
        self.server.server_close()
