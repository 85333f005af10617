"""Crawler client of the egress-proxies lease service.

``LeaseClient`` acquires leases on proxies over the service's REST API and
keeps them renewed; ``egress_proxies.scrapy.EgressProxyMiddleware`` does it
per domain inside Scrapy. ``gateway_proxy_url`` and ``GatewayClient`` use
the gateway instead (``egress_proxies.scrapy.EgressGatewayMiddleware`` in
Scrapy), which leases for the crawler. Standard library only (Scrapy for the
middleware).
"""

from .client import (
    BANNED,
    BLOCKED,
    CAPTCHA,
    ERROR,
    OUTCOMES,
    SCOPE_GLOBAL,
    SCOPE_TARGET,
    SUCCESS,
    TIMEOUT,
    Backoff,
    Cooldown,
    Lease,
    LeaseClient,
    LeaseError,
    LeaseLost,
    LeaseReleased,
    NoProxyAvailable,
    RateLimited,
)
from .gateway import GatewayClient, GatewayError, gateway_proxy_url, gateway_username, proxy_authorization

__all__ = [
    "BANNED", "BLOCKED", "CAPTCHA", "ERROR", "OUTCOMES", "SCOPE_GLOBAL", "SCOPE_TARGET", "SUCCESS", "TIMEOUT",
    "Backoff", "Cooldown", "Lease", "LeaseClient", "LeaseError", "LeaseLost", "LeaseReleased", "NoProxyAvailable",
    "RateLimited", "GatewayClient", "GatewayError", "gateway_proxy_url", "gateway_username",
    "proxy_authorization",
]
__version__ = "0.1.0"
