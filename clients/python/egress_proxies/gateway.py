"""Using the egress-proxies gateway: its proxy URL with options in the
username, and its admin REST API (report a ban on a tunnel, end a session).

Any HTTP client uses the gateway as a plain proxy::

    proxy = gateway_proxy_url("http://gateway:8080", token, session="cart42", pool="web")
    requests.get(url, proxies={"http": proxy, "https": proxy})

The gateway leases a proxy per request (or per session) itself; the
caller never learns a proxy's address or credentials.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from typing import Mapping, Optional

from .client import OUTCOMES, SUCCESS, LeaseError, _RestClient

# A session id, as the gateway takes it.
SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

# What would break the username's structure. The gateway checks each value
# itself and refuses a bad one with 400 naming the option.
_STRUCTURAL = re.compile(r"[,=:@\s/]")


class GatewayError(LeaseError):
    """An error answer of the gateway's admin API, or a bad option."""


def gateway_username(*, session: Optional[str] = None, pool: Optional[str] = None,
                     selector: Optional[Mapping] = None, lifetime: Optional[float] = None) -> str:
    """The username carrying these options (empty for none). ``selector``
    has ``provider``, ``region``, ``zone`` and ``labels`` (a dict);
    ``lifetime`` is the session's lifetime in seconds. A value that would
    break the username's structure raises ValueError naming the option;
    the gateway checks the rest (and answers 400 naming the option)."""
    selector = selector or {}

    def value(name: str, v: str) -> str:
        if not v or _STRUCTURAL.search(v):
            raise ValueError(f"{name}: {v!r} is empty or holds one of , = : @ / or a space")
        return v

    options = []
    if session is not None:
        if not SESSION_ID.fullmatch(session):
            raise ValueError(f"session: {session!r} is not 1-64 of A-Z a-z 0-9 . _ -")
        options.append("session-" + session)
    if pool:
        options.append("pool-" + value("pool", pool))
    for key in ("provider", "region", "zone"):
        if selector.get(key):
            options.append(f"{key}-" + value(f"selector.{key}", selector[key]))
    for k, v in sorted((selector.get("labels") or {}).items()):
        value(f"selector.labels key {k!r}", k.replace("/", ""))  # a key may carry a prefix/
        if v:
            value(f"selector.labels[{k!r}]", v)
        options.append(f"label-{k}={v}")
    if lifetime is not None:
        if session is None:
            raise ValueError("lifetime: only a session has one")
        if lifetime <= 0:
            raise ValueError(f"lifetime: {lifetime} is not a positive number of seconds")
        options.append(f"lifetime-{int(lifetime)}s")
    return ",".join(options)


def gateway_proxy_url(gateway_url: str, token: str, **options) -> str:
    """The proxy URL of the gateway at ``gateway_url`` (``http://gateway:8080``)
    with ``token`` as the password and ``options`` (see gateway_username)
    in the username. It holds the token: never log it. (Scrapy sends no
    credentials from a URL whose username is empty: see
    proxy_authorization.)"""
    netloc = _gateway_netloc(gateway_url)
    user = urllib.parse.quote(gateway_username(**options), safe=",=")
    return f"http://{user}:{urllib.parse.quote(token, safe='')}@{netloc}"


def proxy_authorization(token: str, **options) -> str:
    """The Proxy-Authorization header value carrying ``token`` and
    ``options`` (see gateway_username). It holds the token: never log it."""
    user = gateway_username(**options)
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def _gateway_netloc(gateway_url: str) -> str:
    parsed = urllib.parse.urlsplit(gateway_url)
    if parsed.scheme != "http" or not parsed.hostname or parsed.username or parsed.path not in ("", "/"):
        raise ValueError(f"gateway_url: {urllib.parse.urlunsplit(parsed._replace(netloc=parsed.hostname or ''))!r}"
                         " is not http://host:port")
    return parsed.netloc


class GatewayClient(_RestClient):
    """Talks to a gateway's admin REST API (``http://gateway:8181``) with a
    crawler token: reports what a target answered on a tunnel, whose
    answers the gateway cannot read, and ends sessions."""

    _error = GatewayError

    def report(self, outcome: str, target_host: str, *, session_id: str = "", lease_id: str = "") -> str:
        """Reports ``outcome`` for ``target_host`` on a session or on the
        lease the gateway named (X-Egress-Lease); the proxy cools down for
        the target, and the session's next request moves to another
        proxy. Returns the lease reported on."""
        if outcome not in OUTCOMES or outcome == SUCCESS:
            raise ValueError(f"outcome: {outcome!r} is not a failure outcome")
        if bool(session_id) == bool(lease_id):
            raise ValueError("session_id, lease_id: set exactly one")
        body = {"outcome": outcome, "targetHost": target_host}
        if session_id:
            body["sessionId"] = session_id
        else:
            body["leaseId"] = lease_id
        return self._call("POST", "/v1/outcomes", body).get("leaseId", "")

    def end_session(self, session_id: str) -> bool:
        """Ends a session everywhere (its lease is released); whether it
        had a live lease."""
        if not SESSION_ID.fullmatch(session_id):
            raise ValueError(f"session_id: {session_id!r} is not 1-64 of A-Z a-z 0-9 . _ -")
        return bool(self._call("POST", f"/v1/sessions/{session_id}:end", {}).get("ended"))
