"""Crawls a site with Scrapy through leased proxies, or through the gateway
(run as a process by test_scrapy.py and test_gateway.py: Twisted's reactor
runs once per process).

    python3 crawl_site.py SITE_URL OUT_JSON [lease|gateway]
"""

import json
import sys

import scrapy
from scrapy.crawler import CrawlerProcess

from egress_proxies import BANNED


def access_denied(request, response, spider):
    """The site's own sign of a ban: a 200 page saying so."""
    if b"Access denied" in response.body:
        return BANNED
    return None


class SiteSpider(scrapy.Spider):
    name = "site"

    def __init__(self, start, items, **kw):
        super().__init__(**kw)
        self.start_urls = [start]
        self.items = items

    def parse(self, response):
        header = lambda name: response.headers.get(name, b"").decode("latin-1")  # noqa: E731
        self.items.append({"url": response.url, "status": response.status,
                           "proxy": response.meta.get("egress_proxy_name") or header("X-Egress-Proxy"),
                           "lease": response.meta.get("egress_lease_id") or header("X-Egress-Lease"),
                           "moved": header("X-Egress-Session-Moved"),
                           "session": response.meta.get("egress_session")})
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href, self.parse)


def main():
    site, out = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "lease"
    env = __import__("os").environ
    if mode == "gateway":
        egress = {
            "DOWNLOADER_MIDDLEWARES": {"egress_proxies.scrapy.EgressGatewayMiddleware": 740},
            "EGRESS_GATEWAY_URL": env["EGRESS_GATEWAY_URL"],
            "EGRESS_GATEWAY_ADMIN_URL": env["EGRESS_GATEWAY_ADMIN_URL"],
            "CONCURRENT_REQUESTS": 1,  # one request at a time: the order of proxies is the test's
        }
    else:
        egress = {
            "DOWNLOADER_MIDDLEWARES": {"egress_proxies.scrapy.EgressProxyMiddleware": 740},
            "EGRESS_LEASE_URL": env["EGRESS_LEASE_URL"],
            "EGRESS_LEASE_TTL": 10,
            "EGRESS_ACQUIRE_MAX_WAIT": 60,
            "CONCURRENT_REQUESTS": 2,
        }
    items = []
    process = CrawlerProcess(settings={
        **egress,
        "EGRESS_TOKEN": env.get("EGRESS_TOKEN", ""),
        "EGRESS_BAN_DETECTOR": access_denied,
        "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False,
        "LOG_LEVEL": "INFO",
        "LOG_FILE": out + ".log",
    })
    crawler = process.create_crawler(SiteSpider)
    process.crawl(crawler, start=site, items=items)
    process.start()
    with open(out, "w") as f:
        json.dump({"items": items, "stats": crawler.stats.get_stats()}, f, default=str)


if __name__ == "__main__":
    main()
