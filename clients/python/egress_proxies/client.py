"""Lease client over the lease service's REST API (standard library only).

A crawler acquires a lease on a proxy for a target host, sends its requests
through ``lease.proxy_url``, reports how the target answered and releases
the lease. The lease renews itself on a background thread until released
or lost.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

log = logging.getLogger("egress_proxies")

# Outcomes a crawler reports. Every one but SUCCESS starts a cooldown; the
# service's defaults: BLOCKED 5m, BANNED 1h and CAPTCHA 10m for the lease's
# target; TIMEOUT 1m and ERROR 30s for every target.
SUCCESS = "OUTCOME_SUCCESS"
BLOCKED = "OUTCOME_BLOCKED"
BANNED = "OUTCOME_BANNED"
CAPTCHA = "OUTCOME_CAPTCHA"
TIMEOUT = "OUTCOME_TIMEOUT"
ERROR = "OUTCOME_ERROR"
OUTCOMES = (SUCCESS, BLOCKED, BANNED, CAPTCHA, TIMEOUT, ERROR)

# Cooldown scopes: the lease's target only, or every target.
SCOPE_TARGET = "COOLDOWN_SCOPE_TARGET"
SCOPE_GLOBAL = "COOLDOWN_SCOPE_GLOBAL"

# gRPC codes the REST gateway puts in error bodies.
_NOT_FOUND = 5
_PERMISSION_DENIED = 7
_RESOURCE_EXHAUSTED = 8
_FAILED_PRECONDITION = 9
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16


class LeaseError(Exception):
    """An error answer of the lease service.

    ``code`` is the gRPC code (0 when the service was not reached),
    ``http_status`` the HTTP status, ``details`` the decoded details.
    """

    def __init__(self, message: str, code: int = 0, http_status: int = 0, details: Optional[list] = None):
        super().__init__(message)
        self.code = code
        self.http_status = http_status
        self.details = details or []


class NoProxyAvailable(LeaseError):
    """No proxy qualifies now (RESOURCE_EXHAUSTED, HTTP 409), with how the
    matching proxies were ruled out."""

    def __init__(self, message: str, code: int, http_status: int, details: list):
        super().__init__(message, code, http_status, details)
        counts = next((d for d in details if str(d.get("@type", "")).endswith("NoProxyAvailable")), {})
        self.matching = int(counts.get("matching", 0))
        self.unhealthy = int(counts.get("unhealthy", 0))
        self.at_capacity = int(counts.get("atCapacity", 0))
        self.cooling_down_target = int(counts.get("coolingDownTarget", 0))
        self.cooling_down_global = int(counts.get("coolingDownGlobal", 0))


class RateLimited(LeaseError):
    """The service refused a call over this client's rate limit (HTTP 429);
    ``retry_after`` is the wait it names, in seconds."""

    def __init__(self, message: str, code: int, http_status: int, details: list, retry_after: float):
        super().__init__(message, code, http_status, details)
        self.retry_after = retry_after


class LeaseLost(LeaseError):
    """A lease the service no longer holds for this client: ended elsewhere
    (NOT_FOUND), its proxy no longer leasable (FAILED_PRECONDITION), or not
    renewed before it expired (``expired``)."""

    def __init__(self, lease_id: str, cause: Exception, expired: bool = False):
        what = "expired while renewals failed" if expired else "no longer held"
        super().__init__(f"lease {lease_id} lost: {what}: {cause}", getattr(cause, "code", 0),
                         getattr(cause, "http_status", 0))
        self.lease_id = lease_id
        self.cause = cause
        self.expired = expired


class LeaseReleased(LeaseError):
    """The lease was released by this client."""


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _parse_time(value: str) -> datetime.datetime:
    """An RFC 3339 timestamp as the gateway writes it (up to nanoseconds,
    ``Z`` or an offset) as an aware datetime; datetime keeps microseconds."""
    m = _RFC3339.fullmatch(value)
    if m is None:
        raise LeaseError(f"timestamp {value!r} is not RFC 3339")
    zone = "+00:00" if m.group("zone") in ("Z", "z") else m.group("zone")
    try:
        return datetime.datetime.fromisoformat(f"{m.group('base')}.{(m.group('frac') or '0')[:6]:0<6}{zone}")
    except ValueError as e:
        raise LeaseError(f"timestamp {value!r}: {e}") from None


_RFC3339 = re.compile(r"(?P<base>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(?P<frac>\d+))?(?P<zone>[Zz]|[+-]\d\d:\d\d)")


@dataclass
class Backoff:
    """Exponential backoff with jitter between acquire attempts: each wait is
    ``initial * multiplier**n`` capped at ``maximum``, randomised by
    ±``jitter`` so that a fleet does not retry in lockstep."""

    initial: float = 0.25
    multiplier: float = 1.5
    maximum: float = 15.0
    jitter: float = 0.5

    def waits(self):
        delay = self.initial
        while True:
            yield delay * (1 + self.jitter * (2 * random.random() - 1))
            delay = min(delay * self.multiplier, self.maximum)


@dataclass
class Cooldown:
    """The cooldown in force after a report; ``target_host`` empty for every
    target, ``expire_time`` None when the report started none."""

    target_host: str = ""
    expire_time: Optional[datetime.datetime] = None
    outcome: str = ""


class _RestClient:
    """One service's REST API: base URL, bearer token, TLS, JSON calls.
    Errors are raised as ``_error`` (a LeaseError)."""

    _error = LeaseError

    def __init__(self, base_url: str, token: str = "", *, ca_file: Optional[str] = None,
                 ssl_context: Optional[ssl.SSLContext] = None, timeout: float = 10.0):
        if not base_url:
            raise ValueError("base_url: empty")
        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"base_url: {base_url!r} is not an http(s) URL")
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.timeout = timeout
        if ssl_context is None and parsed.scheme == "https":
            ssl_context = ssl.create_default_context(cafile=ca_file)
        handlers: List[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if ssl_context is not None:
            handlers.append(urllib.request.HTTPSHandler(context=ssl_context))
        # No proxy from the environment: the service is reached directly.
        self._opener = urllib.request.build_opener(*handlers)

    def __repr__(self) -> str:  # never the token
        return f"{type(self).__name__}({self.base_url!r})"

    def _call(self, method: str, path: str, body: Optional[dict] = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        req.add_header("Accept", "application/json")
        if self._token:
            req.add_header("Authorization", "Bearer " + self._token)
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = {}
            message = answer.get("message") or f"HTTP {e.code}"
            code = int(answer.get("code", 0) or 0)
            details = answer.get("details") or []
            if e.code == 429:
                try:
                    retry_after = float(e.headers.get("Retry-After", "1"))
                except ValueError:
                    retry_after = 1.0
                raise RateLimited(f"{method} {path}: {message}", code, e.code, details, retry_after) from None
            if code == _RESOURCE_EXHAUSTED:
                raise NoProxyAvailable(message, code, e.code, details) from None
            raise self._error(f"{method} {path}: {message}", code, e.code, details) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise self._error(f"{method} {path}: {reason}", _UNAVAILABLE, 0) from None


class LeaseClient(_RestClient):
    """Talks to one lease service over REST.

    ``base_url`` is the service's HTTP address (``http://lease:8111`` or
    ``https://…``); ``token`` the crawler's bearer token (empty only for a
    service running with ``--auth-disabled``). TLS: ``ca_file`` verifies the
    service (default: the system roots), or pass a ready ``ssl_context``.
    """

    def __init__(self, base_url: str, token: str = "", *, ca_file: Optional[str] = None,
                 ssl_context: Optional[ssl.SSLContext] = None, timeout: float = 10.0,
                 backoff: Optional[Backoff] = None,
                 on_lost: Optional[Callable[["Lease", LeaseLost], None]] = None):
        super().__init__(base_url, token, ca_file=ca_file, ssl_context=ssl_context, timeout=timeout)
        self.backoff = backoff or Backoff()
        self.on_lost = on_lost
        self._lock = threading.Lock()
        self._leases: Dict[str, "Lease"] = {}

    def list_proxies(self, selector: Optional[Mapping] = None) -> List[dict]:
        """The leasable proxies matching ``selector`` (REST JSON objects)."""
        query = []
        for key in ("provider", "region", "zone"):
            if selector and selector.get(key):
                query.append((f"selector.{key}", selector[key]))
        for k, v in ((selector or {}).get("labels") or {}).items():
            query.append((f"selector.labels[{k}]", v))
        # Pages of 1,000: one reply for a large pool would be huge.
        query.append(("page_size", "1000"))
        proxies: List[dict] = []
        token = ""
        while True:
            page = query + ([("page_token", token)] if token else [])
            resp = self._call("GET", "/v1/leasable-proxies?" + urllib.parse.urlencode(page))
            proxies.extend(resp.get("proxies", []))
            token = resp.get("next_page_token") or resp.get("nextPageToken") or ""
            if not token:
                return proxies

    def try_acquire(self, target_host: str = "", selector: Optional[Mapping] = None,
                    ttl: Optional[float] = None) -> "Lease":
        """Asks once for a lease; raises NoProxyAvailable when none qualifies.

        ``selector`` is a dict with ``provider``, ``region``, ``zone`` and
        ``labels`` (all optional); ``ttl`` in seconds (None: the service's
        default)."""
        body: dict = {"targetHost": target_host}
        if selector:
            body["selector"] = dict(selector)
        if ttl is not None:
            body["ttl"] = _duration(ttl)
        answer = self._call("POST", "/v1/leases", body)
        lease = Lease(self, answer["lease"], ttl, answer.get("credentials"))
        with self._lock:
            self._leases[lease.id] = lease
        lease._start()
        return lease

    def acquire(self, target_host: str = "", selector: Optional[Mapping] = None,
                ttl: Optional[float] = None, max_wait: Optional[float] = 300.0) -> "Lease":
        """Like try_acquire, but waits with backoff and jitter while no proxy
        is available (RESOURCE_EXHAUSTED, HTTP 409), the caller is rate
        limited (HTTP 429) or the service is unavailable, for at most
        ``max_wait`` seconds (None: for ever); then raises the last error."""
        deadline = None if max_wait is None else time.monotonic() + max_wait
        for wait in self.backoff.waits():
            try:
                return self.try_acquire(target_host, selector, ttl)
            except LeaseError as e:
                if not isinstance(e, NoProxyAvailable) and e.code != _UNAVAILABLE and e.http_status not in (429, 503):
                    raise
                if isinstance(e, RateLimited):
                    wait = max(wait, e.retry_after)
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    wait = min(wait, left)
                log.debug("no lease for %s yet (%s); retrying in %.2fs", target_host or "any target", e, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Releases every lease still held."""
        with self._lock:
            held = list(self._leases.values())
        for lease in held:
            lease.release()

    def _forget(self, lease: "Lease") -> None:
        with self._lock:
            self._leases.pop(lease.id, None)

    def __enter__(self) -> "LeaseClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Lease:
    """A hold on one proxy, renewed on a background thread until released or
    lost. Use it as a context manager, or call ``release()`` on every exit
    path: it is idempotent and safe after a loss."""

    def __init__(self, client: LeaseClient, data: dict, ttl: Optional[float], credentials: Optional[dict] = None):
        address = data.get("address") or {}
        if not address.get("host") or not address.get("port"):
            raise LeaseError(f"lease {data.get('leaseId')} has no proxy address")
        self.client = client
        self.id: str = data["leaseId"]
        self.proxy_name: str = data.get("proxyName", "")
        self.proxy_uid: str = data.get("proxyUid", "")
        self.target_host: str = data.get("targetHost", "")
        host = address["host"]
        if ":" in host:
            host = f"[{host}]"
        # The proxy's credentials from the acquire's answer go into the URL,
        # so that urllib, requests and Scrapy send Proxy-Authorization
        # without any setting. Never log proxy_url: repr() leaves it out.
        userinfo = ""
        if credentials and credentials.get("username"):
            userinfo = (urllib.parse.quote(credentials["username"], safe="") + ":"
                        + urllib.parse.quote(credentials.get("password", ""), safe="") + "@")
        self.proxy_url = f"{address.get('scheme') or 'http'}://{userinfo}{host}:{address['port']}"
        self.expire_time = _parse_time(data["expireTime"])
        granted = (self.expire_time - _parse_time(data["acquireTime"])).total_seconds()
        self._ttl = ttl
        # Three renewals per TTL: two may fail before the lease runs out.
        self._period = max((ttl or granted) / 3, 0.1)
        self._stop = threading.Event()
        self.ended = threading.Event()  # set when released or lost
        self.error: Optional[LeaseError] = None
        self._lock = threading.Lock()
        self._release_lock = threading.Lock()
        self._release_result: Optional[bool] = None
        self._thread = threading.Thread(target=self._keep_alive, name=f"lease-{self.id[:8]}", daemon=True)

    def __repr__(self) -> str:
        return f"Lease({self.id!r}, proxy={self.proxy_name!r}, target={self.target_host!r})"

    def _start(self) -> None:
        self._thread.start()

    def _finish(self, err: LeaseError) -> bool:
        with self._lock:
            if self.error is not None:
                return False
            self.error = err
        self.ended.set()
        self.client._forget(self)
        return True

    def _keep_alive(self) -> None:
        body = {} if self._ttl is None else {"ttl": _duration(self._ttl)}
        wait = self._period
        retry = 0.2
        while not self._stop.wait(wait):
            try:
                answer = self.client._call("POST", f"/v1/leases/{urllib.parse.quote(self.id)}:renew", body)
                self.expire_time = _parse_time(answer["lease"]["expireTime"])
                wait, retry = self._period, 0.2
            except LeaseError as e:
                if self._stop.is_set():
                    return
                definitive = e.code in (_NOT_FOUND, _FAILED_PRECONDITION, _PERMISSION_DENIED, _UNAUTHENTICATED)
                if definitive or (400 <= e.http_status < 500 and e.code != _RESOURCE_EXHAUSTED):
                    self._lose(LeaseLost(self.id, e))
                    return
                left = (self.expire_time - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
                if left <= 0:
                    self._lose(LeaseLost(self.id, e, expired=True))
                    return
                wait, retry = min(retry, left), min(retry * 2, self._period)

    def _lose(self, err: LeaseLost) -> None:
        if not self._finish(err):
            return
        log.warning("WARNING: proxy lease %s on %s lost; requests through it stop: %s", self.id, self.proxy_name, err.cause)
        # A lease whose proxy stopped being leasable still holds its slot
        # until released.
        self._release_call()
        if self.client.on_lost is not None:
            self.client.on_lost(self, err)

    @property
    def active(self) -> bool:
        return not self.ended.is_set()

    def report(self, outcome: str, cooldown: Optional[float] = None, scope: Optional[str] = None) -> Cooldown:
        """Tells the service how the target treated a request through this
        lease. ``cooldown`` in seconds replaces the outcome's default length
        (0: none); ``scope`` (SCOPE_TARGET, SCOPE_GLOBAL) its default scope.
        Accepted after release too, while the service retains the lease."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome: {outcome!r} is not one of {', '.join(OUTCOMES)}")
        if scope not in (None, SCOPE_TARGET, SCOPE_GLOBAL):
            raise ValueError(f"scope: {scope!r} is not SCOPE_TARGET or SCOPE_GLOBAL")
        body: dict = {"outcome": outcome}
        if cooldown is not None:
            body["cooldown"] = _duration(cooldown)
        if scope is not None:
            body["scope"] = scope
        answer = self.client._call("POST", f"/v1/leases/{urllib.parse.quote(self.id)}:report", body)
        cd = answer.get("cooldown")
        if not cd:
            return Cooldown()
        return Cooldown(cd.get("targetHost", ""), _parse_time(cd["expireTime"]), cd.get("outcome", ""))

    def release(self) -> bool:
        """Ends the lease and frees the proxy. Idempotent; returns False when
        the service could not be told (the lease then ends at its expiry)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._finish(LeaseReleased(f"lease {self.id} released"))
        return self._release_call()

    def _release_call(self) -> bool:
        # Once: later calls return the first call's result.
        with self._release_lock:
            if self._release_result is None:
                self._release_result = self._release_once()
            return self._release_result

    def _release_once(self) -> bool:
        deadline = time.monotonic() + self.client.timeout
        delay = 0.1
        while True:
            try:
                self.client._call("POST", f"/v1/leases/{urllib.parse.quote(self.id)}:release", {})
                return True
            except LeaseError as e:
                if e.code == _NOT_FOUND:
                    return True  # no longer retained, so not held either
                transient = e.code == _UNAVAILABLE or isinstance(e, RateLimited)
                if isinstance(e, RateLimited):
                    delay = max(delay, e.retry_after)
                if not transient or time.monotonic() + delay > deadline:
                    log.warning("WARNING: releasing proxy lease %s failed; it ends at its expiry %s: %s",
                                self.id, self.expire_time.isoformat(), e)
                    return False
                time.sleep(delay)
                delay *= 2

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
