"""Crawler client of the egress-proxies lease service.

``LeaseClient`` acquires leases on proxies over the service's REST API and
keeps them renewed; ``egress_proxies.scrapy.EgressProxyMiddleware`` does it
per domain inside Scrapy. Standard library only (Scrapy for the
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

__all__ = [
    "BANNED", "BLOCKED", "CAPTCHA", "ERROR", "OUTCOMES", "SCOPE_GLOBAL", "SCOPE_TARGET", "SUCCESS", "TIMEOUT",
    "Backoff", "Cooldown", "Lease", "LeaseClient", "LeaseError", "LeaseLost", "LeaseReleased", "NoProxyAvailable",
    "RateLimited",
]
__version__ = "0.1.0"
