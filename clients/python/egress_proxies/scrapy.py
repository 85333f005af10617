"""Scrapy downloader middlewares: EgressProxyMiddleware sends every request
through a proxy leased for its domain from the egress-proxies lease service;
EgressGatewayMiddleware (at the end of this module) sends them through the
gateway instead, which leases for them.

Enable it before Scrapy's HttpProxyMiddleware (750)::

    DOWNLOADER_MIDDLEWARES = {"egress_proxies.scrapy.EgressProxyMiddleware": 740}
    EGRESS_LEASE_URL = "http://lease:8111"      # the lease service's REST address
    EGRESS_TOKEN = "..."                        # a crawler token

Settings (all optional but EGRESS_LEASE_URL):

- ``EGRESS_TOKEN``, ``EGRESS_CA_FILE``: bearer token; CA bundle verifying an
  https lease service (default: the system roots).
- ``EGRESS_SELECTOR``: dict with ``provider``, ``region``, ``zone``, ``labels``.
- ``EGRESS_LEASE_TTL``: lease TTL in seconds (default 120; renewed in the
  background).
- ``EGRESS_ACQUIRE_MAX_WAIT``: how long a request waits for a proxy while
  none is available, in seconds (default 300), with backoff and jitter.
- ``EGRESS_BAN_CODES``: HTTP status → outcome (default 403 → BLOCKED,
  429 → BANNED).
- ``EGRESS_BAN_DETECTOR``: a callable ``(request, response, spider) ->
  outcome or None``, or its import path, consulted before the status codes
  for a site's own signs of a ban (a captcha page answered 200).
- ``EGRESS_MAX_BAN_RETRIES``: how often one request is sent again through
  another proxy after a ban (default 3); then the ban answer is returned.
- ``EGRESS_IDLE_RELEASE``: release a domain's lease once none of its
  requests has been in flight for this many seconds (default 60; 0 keeps
  leases until the spider closes).

A ban is reported on the lease that met it (a cooldown for that domain with
the service's defaults), the lease is released and the request scheduled
again; the next request for the domain leases another proxy. Timeouts and
connection errors are reported as TIMEOUT and ERROR (cooldowns for every
target) and Scrapy's RetryMiddleware retries them through a new lease.
Every lease is released when the spider closes, and a domain's lease once
the domain has been idle for ``EGRESS_IDLE_RELEASE``. Requests that already carry
``meta['proxy']`` set by someone else, or ``meta['egress_skip']``, are left
alone.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
import urllib.parse
from typing import Callable, Dict, Optional

from scrapy import signals
from scrapy.exceptions import NotConfigured
from scrapy.utils.misc import load_object
from twisted.internet import defer, task, threads
from twisted.internet.error import TCPTimedOutError, TimeoutError as TwistedTimeoutError

from .client import BANNED, BLOCKED, ERROR, SUCCESS, TIMEOUT, Lease, LeaseClient, LeaseError
from .gateway import SESSION_ID, GatewayClient, _gateway_netloc, proxy_authorization

log = logging.getLogger("egress_proxies.scrapy")

META_LEASE = "egress_lease_id"
META_PROXY_NAME = "egress_proxy_name"
META_RETRIES = "egress_ban_retries"

DEFAULT_BAN_CODES = {403: BLOCKED, 429: BANNED}


def _ban_settings(s):
    """EGRESS_BAN_CODES and EGRESS_BAN_DETECTOR (a callable or its import
    path) from Scrapy settings."""
    detector = s.get("EGRESS_BAN_DETECTOR")
    if isinstance(detector, str):
        detector = load_object(detector)
    codes = s.getdict("EGRESS_BAN_CODES") or None
    if codes is not None:
        codes = {int(k): v for k, v in codes.items()}
    return codes, detector


class EgressProxyMiddleware:
    def __init__(self, client: LeaseClient, *, selector: Optional[dict] = None, ttl: float = 120.0,
                 max_wait: float = 300.0, ban_codes: Optional[Dict[int, str]] = None,
                 ban_detector: Optional[Callable] = None, max_ban_retries: int = 3, stats=None,
                 idle_release: float = 60.0):
        self.client = client
        self.selector = selector
        self.ttl = ttl
        self.max_wait = max_wait
        self.ban_codes = dict(DEFAULT_BAN_CODES if ban_codes is None else ban_codes)
        self.ban_detector = ban_detector
        self.max_ban_retries = max_ban_retries
        self.stats = stats
        self._lock = threading.Lock()
        self._domain_locks: Dict[str, threading.Lock] = {}
        self._held: Dict[str, Lease] = {}  # domain → its lease
        self._all: Dict[str, Lease] = {}  # id → every lease of this spider, for late reports
        self.idle_release = idle_release
        self._inflight: Dict[str, int] = {}  # domain → requests in flight
        self._last_used: Dict[str, float] = {}  # domain → when its last request ended
        self._idle_loop = None

    @classmethod
    def from_crawler(cls, crawler):
        s = crawler.settings
        url = s.get("EGRESS_LEASE_URL")
        if not url:
            raise NotConfigured("EGRESS_LEASE_URL is not set")
        codes, detector = _ban_settings(s)
        client = LeaseClient(url, s.get("EGRESS_TOKEN", ""), ca_file=s.get("EGRESS_CA_FILE") or None)
        mw = cls(client, selector=s.getdict("EGRESS_SELECTOR") or None, ttl=s.getfloat("EGRESS_LEASE_TTL", 120.0),
                 max_wait=s.getfloat("EGRESS_ACQUIRE_MAX_WAIT", 300.0), ban_codes=codes, ban_detector=detector,
                 max_ban_retries=s.getint("EGRESS_MAX_BAN_RETRIES", 3), stats=crawler.stats,
                 idle_release=s.getfloat("EGRESS_IDLE_RELEASE", 60.0))
        crawler.signals.connect(mw.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(mw.spider_closed, signal=signals.spider_closed)
        return mw

    # -- leases ---------------------------------------------------------

    @staticmethod
    def domain(request) -> str:
        return (urllib.parse.urlsplit(request.url).hostname or "").rstrip(".").lower()

    def _current(self, domain: str) -> Optional[Lease]:
        with self._lock:
            lease = self._held.get(domain)
        return lease if lease is not None and lease.active else None

    def _lease_for(self, domain: str) -> Lease:
        """Runs on a thread: the domain's lease, acquired if needed (one
        acquire per domain at a time)."""
        with self._lock:
            dlock = self._domain_locks.setdefault(domain, threading.Lock())
        with dlock:
            lease = self._current(domain)
            if lease is not None:
                with self._lock:  # not idle: a request is about to use it
                    self._last_used[domain] = time.monotonic()
                return lease
            lease = self.client.acquire(domain, self.selector, self.ttl, max_wait=self.max_wait)
            with self._lock:
                self._held[domain] = lease
                self._all[lease.id] = lease
                self._last_used[domain] = time.monotonic()
            self._inc("egress/leases_acquired")
            log.debug("leased %s for %s (lease %s)", lease.proxy_name, domain, lease.id)
            return lease

    def _drop(self, domain: str, lease_id: str, outcome: str) -> None:
        """Runs on a thread: forget the domain's lease (unless already
        replaced), report, release."""
        with self._lock:
            lease = self._all.get(lease_id)
            if lease is not None and self._held.get(domain) is lease:
                del self._held[domain]
        if lease is None:
            return
        try:
            lease.report(outcome)
        except LeaseError as e:
            log.warning("WARNING: reporting %s for %s on %s failed; the proxy may be offered for it again: %s",
                        outcome, domain, lease.proxy_name, e)
        lease.release()

    def _begin(self, domain: str) -> None:
        with self._lock:
            self._inflight[domain] = self._inflight.get(domain, 0) + 1

    def _end(self, request) -> None:
        if request.meta.pop("_egress_counted", None) is None:
            return
        domain = self.domain(request)
        with self._lock:
            self._inflight[domain] = max(self._inflight.get(domain, 0) - 1, 0)
            self._last_used[domain] = time.monotonic()

    def idle_leases(self, now: Optional[float] = None):
        """Forgets and returns the leases of domains with nothing in flight
        for ``idle_release`` seconds; the caller releases them."""
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            for domain, lease in list(self._held.items()):
                idle = now - self._last_used.get(domain, now)
                if self._inflight.get(domain, 0) == 0 and idle >= self.idle_release:
                    del self._held[domain]
                    out.append(lease)
        return out

    def _release_idle(self):
        leases = self.idle_leases()
        if not leases:
            return None
        for lease in leases:
            log.debug("releasing the idle lease %s on %s for %s", lease.id, lease.proxy_name, lease.target_host)
            self._inc("egress/leases_released_idle")
        return threads.deferToThread(lambda: [lease.release() for lease in leases])

    def _apply(self, request, lease: Lease):
        if request.meta.get("_egress_counted") is None:
            request.meta["_egress_counted"] = True
            self._begin(self.domain(request))
        request.meta["proxy"] = lease.proxy_url
        request.meta[META_LEASE] = lease.id
        request.meta[META_PROXY_NAME] = lease.proxy_name
        return None

    def _inc(self, key: str) -> None:
        if self.stats is not None:
            self.stats.inc_value(key)

    # -- downloader middleware -------------------------------------------

    def process_request(self, request, spider):
        if request.meta.get("egress_skip") or ("proxy" in request.meta and META_LEASE not in request.meta):
            return None
        domain = self.domain(request)
        if not domain:
            return None
        lease = self._current(domain)
        if lease is not None:
            return self._apply(request, lease)
        d = threads.deferToThread(self._lease_for, domain)
        d.addCallback(lambda lease: self._apply(request, lease))
        return d

    def classify(self, request, response, spider) -> Optional[str]:
        """The outcome to report for a response, None or SUCCESS for none."""
        if self.ban_detector is not None:
            outcome = self.ban_detector(request, response, spider)
            if outcome:
                return outcome
        return self.ban_codes.get(response.status)

    def process_response(self, request, response, spider):
        self._end(request)
        lease_id = request.meta.get(META_LEASE)
        if not lease_id:
            return response
        outcome = self.classify(request, response, spider)
        if not outcome or outcome == SUCCESS:
            return response
        domain = self.domain(request)
        retries = request.meta.get(META_RETRIES, 0)
        log.info("ban on %s through %s: %s (HTTP %d); reported, moving to another proxy",
                 request.url, request.meta.get(META_PROXY_NAME), outcome, response.status)
        self._inc(f"egress/bans/{outcome}")
        d = threads.deferToThread(self._drop, domain, lease_id, outcome)
        if retries >= self.max_ban_retries:
            d.addCallback(lambda _: response)
            return d
        again = request.replace(dont_filter=True)
        again.meta[META_RETRIES] = retries + 1
        for key in ("proxy", META_LEASE, META_PROXY_NAME, "_egress_counted"):
            again.meta.pop(key, None)
        d.addCallback(lambda _: again)
        return d

    def process_exception(self, request, exception, spider):
        self._end(request)
        lease_id = request.meta.get(META_LEASE)
        if not lease_id:
            return None
        timeout = isinstance(exception, (TwistedTimeoutError, TCPTimedOutError, defer.TimeoutError))
        outcome = TIMEOUT if timeout else ERROR
        self._inc(f"egress/failures/{outcome}")
        d = threads.deferToThread(self._drop, self.domain(request), lease_id, outcome)
        d.addCallback(lambda _: None)
        return d

    def spider_opened(self, spider):
        if self.idle_release > 0:
            self._idle_loop = task.LoopingCall(self._release_idle)
            self._idle_loop.start(max(self.idle_release / 4, 0.5), now=False)

    def spider_closed(self, spider):
        if self._idle_loop is not None and self._idle_loop.running:
            self._idle_loop.stop()
        return threads.deferToThread(self.release_all)

    def release_all(self) -> None:
        """Releases every lease of this spider."""
        with self._lock:
            leases = list(self._all.values())
            self._held.clear()
        for lease in leases:
            lease.release()
        self.client.close()


META_SESSION = "egress_session"

SESSION_MODES = ("domain", "spider", "none")


class EgressGatewayMiddleware:
    """Scrapy downloader middleware sending every request through the
    egress-proxies gateway, which leases the proxies itself.

    Enable it before Scrapy's HttpProxyMiddleware (750), instead of
    EgressProxyMiddleware::

        DOWNLOADER_MIDDLEWARES = {"egress_proxies.scrapy.EgressGatewayMiddleware": 740}
        EGRESS_GATEWAY_URL = "http://gateway:8080"        # the gateway's proxy port
        EGRESS_GATEWAY_ADMIN_URL = "http://gateway:8181"  # its REST port: reports bans on tunnels
        EGRESS_TOKEN = "..."                              # a crawler token

    Settings (all optional but EGRESS_GATEWAY_URL):

    - ``EGRESS_GATEWAY_SESSION``: ``domain`` (default: each domain keeps one
      proxy, as a session), ``spider`` (one session for the whole crawl) or
      ``none`` (a proxy per request, rotating).
    - ``EGRESS_SESSION_PREFIX``: what session ids start with (default: new
      for each crawl, so two crawls do not share a session).
    - ``EGRESS_SESSION_LIFETIME``: seconds a session lives idle (the
      gateway's default otherwise).
    - ``EGRESS_POOL``, ``EGRESS_SELECTOR``: which proxies (as for
      EgressProxyMiddleware).
    - ``EGRESS_BAN_CODES``, ``EGRESS_BAN_DETECTOR``, ``EGRESS_MAX_BAN_RETRIES``:
      as for EgressProxyMiddleware.
    - ``EGRESS_CA_FILE``: CA bundle verifying an https admin URL.

    A ban is reported on the request's session (or, without sessions, on
    the lease the gateway named in ``X-Egress-Lease``, which plain-HTTP
    answers carry and tunnelled HTTPS answers cannot), and the request is
    sent again: the session moves to another proxy, which the gateway
    shows in ``X-Egress-Session-Moved``. Without an admin URL nothing is
    reported and only the gateway's own ban rules (plain HTTP) apply. The
    spider's sessions are ended when it closes, releasing their proxies.
    """

    def __init__(self, gateway_url: str, token: str, *, admin: Optional[GatewayClient] = None,
                 session_mode: str = "domain", session_prefix: Optional[str] = None,
                 lifetime: Optional[float] = None, pool: Optional[str] = None, selector: Optional[dict] = None,
                 ban_codes: Optional[Dict[int, str]] = None, ban_detector: Optional[Callable] = None,
                 max_ban_retries: int = 3, stats=None):
        if session_mode not in SESSION_MODES:
            raise ValueError(f"EGRESS_GATEWAY_SESSION: {session_mode!r} is not one of {', '.join(SESSION_MODES)}")
        # The token goes in a Proxy-Authorization header rather than the
        # proxy URL: Scrapy sends none from a URL with an empty username
        # (rotation with no options), and meta['proxy'] stays free of it.
        self.proxy = "http://" + _gateway_netloc(gateway_url)
        self._token = token
        self.admin = admin
        self.session_mode = session_mode
        self.session_prefix = session_prefix if session_prefix is not None else secrets.token_hex(4) + "."
        self.lifetime = lifetime
        self.pool = pool
        self.selector = selector
        self.ban_codes = dict(DEFAULT_BAN_CODES if ban_codes is None else ban_codes)
        self.ban_detector = ban_detector
        self.max_ban_retries = max_ban_retries
        self.stats = stats
        self._lock = threading.Lock()
        self._sessions: set = set()
        self._auth: Dict[Optional[str], str] = {}  # session id → Proxy-Authorization
        # Fails at start on options that would break the username.
        self._authorization(self.session_id_for("example.com", "spider"))

    @classmethod
    def from_crawler(cls, crawler):
        s = crawler.settings
        url = s.get("EGRESS_GATEWAY_URL")
        if not url:
            raise NotConfigured("EGRESS_GATEWAY_URL is not set")
        codes, detector = _ban_settings(s)
        token = s.get("EGRESS_TOKEN", "")
        admin_url = s.get("EGRESS_GATEWAY_ADMIN_URL")
        admin = GatewayClient(admin_url, token, ca_file=s.get("EGRESS_CA_FILE") or None) if admin_url else None
        lifetime = s.getfloat("EGRESS_SESSION_LIFETIME", 0.0) or None
        mw = cls(url, token, admin=admin, session_mode=s.get("EGRESS_GATEWAY_SESSION", "domain"),
                 session_prefix=s.get("EGRESS_SESSION_PREFIX"), lifetime=lifetime, pool=s.get("EGRESS_POOL"),
                 selector=s.getdict("EGRESS_SELECTOR") or None, ban_codes=codes, ban_detector=detector,
                 max_ban_retries=s.getint("EGRESS_MAX_BAN_RETRIES", 3), stats=crawler.stats)
        crawler.signals.connect(mw.spider_closed, signal=signals.spider_closed)
        return mw

    def session_id_for(self, domain: str, spider_name: str) -> Optional[str]:
        """The session of a request to ``domain`` by spider ``spider_name``;
        None without sessions. Ids the gateway cannot take (too long, other
        characters) are replaced by a digest of themselves."""
        if self.session_mode == "none":
            return None
        key = domain if self.session_mode == "domain" else spider_name
        sid = self.session_prefix + key
        if not SESSION_ID.fullmatch(sid):
            sid = self.session_prefix + hashlib.sha256(key.encode()).hexdigest()[:24]
        if not SESSION_ID.fullmatch(sid):
            raise ValueError(f"EGRESS_SESSION_PREFIX: {self.session_prefix!r} makes session ids the gateway refuses")
        return sid

    def _authorization(self, session: Optional[str]) -> str:
        value = self._auth.get(session)
        if value is None:
            value = proxy_authorization(self._token, session=session, pool=self.pool, selector=self.selector,
                                        lifetime=self.lifetime if session else None)
            self._auth[session] = value
        return value

    def _inc(self, key: str) -> None:
        if self.stats is not None:
            self.stats.inc_value(key)

    # The same decision as the leasing middleware's: a detector, then codes.
    classify = EgressProxyMiddleware.classify

    def process_request(self, request, spider):
        if request.meta.get("egress_skip") or ("proxy" in request.meta and META_SESSION not in request.meta):
            return None
        domain = EgressProxyMiddleware.domain(request)
        if not domain:
            return None
        session = self.session_id_for(domain, getattr(spider, "name", "") or "spider")
        if session is not None:
            with self._lock:
                self._sessions.add(session)
        request.meta["proxy"] = self.proxy
        request.headers["Proxy-Authorization"] = self._authorization(session)
        request.meta[META_SESSION] = session
        return None

    def process_response(self, request, response, spider):
        if META_SESSION not in request.meta:
            return response
        outcome = self.classify(request, response, spider)
        if not outcome or outcome == SUCCESS:
            return response
        session = request.meta[META_SESSION]
        via = response.headers.get("X-Egress-Proxy", b"").decode("latin-1")
        lease_id = response.headers.get("X-Egress-Lease", b"").decode("latin-1")
        retries = request.meta.get(META_RETRIES, 0)
        log.info("ban on %s through %s: %s (HTTP %d); reported, moving to another proxy",
                 request.url, via or "the gateway", outcome, response.status)
        self._inc(f"egress/bans/{outcome}")
        d = threads.deferToThread(self._report, outcome, EgressProxyMiddleware.domain(request), session, lease_id)
        if retries >= self.max_ban_retries:
            d.addCallback(lambda _: response)
            return d
        again = request.replace(dont_filter=True)
        again.meta[META_RETRIES] = retries + 1
        d.addCallback(lambda _: again)
        return d

    def _report(self, outcome: str, domain: str, session: Optional[str], lease_id: str) -> None:
        """Runs on a thread: reports a ban through the gateway's admin API."""
        if self.admin is None:
            return
        try:
            if session:
                self.admin.report(outcome, domain, session_id=session)
            elif lease_id:
                self.admin.report(outcome, domain, lease_id=lease_id)
            else:
                log.debug("a ban on %s in a tunnel without a session cannot be reported", domain)
        except LeaseError as e:
            log.warning("WARNING: reporting %s for %s failed; the proxy may be offered for it again: %s",
                        outcome, domain, e)

    def spider_closed(self, spider):
        return threads.deferToThread(self.end_sessions)

    def end_sessions(self) -> None:
        """Ends every session of this spider, releasing their proxies."""
        with self._lock:
            sessions, self._sessions = self._sessions, set()
        if self.admin is None:
            return
        for session in sorted(sessions):
            try:
                self.admin.end_session(session)
            except LeaseError as e:
                log.warning("WARNING: ending session %s failed; its proxy is held until it idles out: %s", session, e)
