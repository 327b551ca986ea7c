"""What model sources a node's agent may read: its policy, checked before a byte moves.

- A local source must lie under one of the directories the agent is given (``--model-dir``,
  repeatable), after every symlink is followed: a link that leaves them is refused. Without any
  such directory no local source is read.
- A remote source (http(s), the Hugging Face Hub, and every redirect on the way) must not resolve
  to a loopback, link-local (169.254/16, fe80::/10), unspecified or cloud metadata address unless
  the agent allows private sources (``--allow-private-sources``): a model document must not turn
  the agent into a proxy to the node's own services or its cloud credentials.

A refusal is a SourceRefused naming the source, the rule and the flag that lifts it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from fleetserve.errors import SourceRefused

# Addresses cloud providers serve instance metadata (and credentials) on, beyond link-local ones.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, ...
        "fd00:ec2::254",  # AWS over IPv6
        "100.100.100.200",  # Alibaba Cloud
        "169.254.170.2",  # AWS ECS task credentials
    )
)
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata"})

# host, port → the addresses it resolves to (socket.getaddrinfo by default; tests hand in a table).
Resolver = Callable[[str, int], Sequence[str]]


def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as the system resolver answers."""
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return []  # the connection itself will say the host is unknown
    return [str(info[4][0]) for info in infos]


def forbidden_reason(address: str) -> str | None:
    """Why an agent may not fetch from ``address`` by default, or None when it may."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_unspecified:
        return "the unspecified address"
    return None


@dataclass(frozen=True)
class SourcePolicy:
    """The sources one agent may read: its model directories (None = any local file) and whether
    private addresses (loopback, link-local, metadata) are allowed for remote sources."""

    model_dirs: tuple[Path, ...] | None = None
    allow_private: bool = True
    resolver: Resolver = system_resolver

    @classmethod
    def strict(cls, model_dirs: Sequence[Path] = (), allow_private: bool = False) -> SourcePolicy:
        """The agent's policy: local files only under ``model_dirs``, no private addresses unless allowed."""
        return cls(tuple(Path(os.path.realpath(d)) for d in model_dirs), allow_private)

    def local(self, path: Path) -> Path:
        """The real path of a local source, once every symlink is followed; SourceRefused when it
        lies outside the model directories."""
        real = Path(os.path.realpath(path))
        if self.model_dirs is None:
            return real
        if not self.model_dirs:
            raise SourceRefused(
                f"{path}: this agent reads no local model files; start it with --model-dir DIR "
                "naming the directory that holds them"
            )
        for folder in self.model_dirs:
            if real == folder or real.is_relative_to(folder):
                return real
        shown = ", ".join(str(d) for d in self.model_dirs)
        via = f" (it resolves to {real})" if real != Path(os.path.abspath(path)) else ""
        raise SourceRefused(
            f"{path}: outside the agent's model directories ({shown}){via}; local sources must lie "
            "under a --model-dir, and symlinks out of one are refused"
        )

    def check_url(self, url: str) -> None:
        """Refuse a URL whose host is, or resolves to, a private address the policy forbids."""
        if self.allow_private:
            return
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        if not host:
            raise SourceRefused(f"{url}: the URL has no host")
        if host in METADATA_HOSTS:
            raise SourceRefused(_refusal(url, host, "a cloud metadata host"))
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise SourceRefused(f"{url}: the URL's port is invalid") from None
        addresses = [host] if _is_ip(host) else list(self.resolver(host, port))
        for address in addresses:
            reason = forbidden_reason(address)
            if reason is not None:
                raise SourceRefused(_refusal(url, address, reason))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _refusal(url: str, address: str, reason: str) -> str:
    return (
        f"{url}: {address} is {reason}; this agent does not fetch models from loopback, link-local or "
        "metadata addresses (start it with --allow-private-sources to allow them)"
    )
