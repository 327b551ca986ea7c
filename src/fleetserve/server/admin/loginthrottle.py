"""How often the dashboard's login may be tried: a bounded count of failures per client address
in a sliding window, and a cap on all failures together (a guesser with many addresses) that
holds back only addresses that have failed themselves: an address with no failure in the window
is always heard, so a guesser rotating addresses never locks out an admin with a valid token.
The address is the connection's (a forwarded one only from ``--forwarded-allow-ips`` proxies).

Admin tokens are 256 random bits, so guessing one is hopeless anyway; the bound keeps a guesser
from turning the login into a load on the store. Pure: the caller passes ``now`` (monotonic
seconds). Memory is bounded: at most ``max_addresses`` addresses are remembered, the oldest
forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ThrottlePolicy:
    """At most ``per_address`` failed logins per address and ``overall`` in all per ``window``
    seconds; at most ``max_addresses`` addresses remembered."""

    per_address: int = 10
    overall: int = 200
    window: float = 300.0
    max_addresses: int = 10_000


class LoginThrottle:
    """Failed logins per client address over a sliding window."""

    def __init__(self, policy: ThrottlePolicy | None = None) -> None:
        self.policy = policy or ThrottlePolicy()
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._all: deque[float] = deque()

    def _trim(self, times: deque[float], now: float) -> None:
        while times and times[0] <= now - self.policy.window:
            times.popleft()

    def retry_after(self, address: str, now: float) -> float | None:
        """Seconds until ``address`` may try again; None: it may try now (always, for an address
        with no failure in the window, whatever the others did)."""
        self._trim(self._all, now)
        times = self._failures.get(address)
        if times is not None:
            self._trim(times, now)
        if not times:
            return None
        waits = []
        if len(self._all) >= self.policy.overall:
            waits.append(self._all[0] + self.policy.window - now)
        if len(times) >= self.policy.per_address:
            waits.append(times[0] + self.policy.window - now)
        return max(waits) if waits else None

    def failed(self, address: str, now: float) -> None:
        """Count one failed login from ``address``."""
        times = self._failures.pop(address, None) or deque()
        times.append(now)
        self._failures[address] = times  # most recently failed last
        self._all.append(now)
        while len(self._failures) > self.policy.max_addresses:
            self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        """Forget ``address``'s failures: its holder has a valid token."""
        self._failures.pop(address, None)
