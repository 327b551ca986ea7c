"""The control plane's enrolment policy: which join-token enrolments go through without an
operator, and which addresses a node may give for itself.

- New names: refused until an operator approves them (``fleetserve nodes approve NAME``), unless
  the server runs with ``--approve-new-nodes`` (``fleetserve up`` does, on loopback). A name
  already enrolled (or declared by an operator) always needs an approval.
- Addresses: the address a node gives (where the gateway and peers reach its engines) must be
  the source address of its connection, or inside one of the operator's ``--node-address-allow``
  networks. A DNS name must resolve to such an address. An empty address is allowed: nothing is
  routed to it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str], list[str]]


class AddressVerdict(StrEnum):
    """Whether a node's given address is accepted, and why."""

    SOURCE = "source"  # it is the connection's source address
    ALLOWED = "allowed"  # inside an allowed network
    EMPTY = "empty"  # no address: nothing is routed to the node
    REFUSED = "refused"


def _ip(text: str) -> IpAddress | None:
    try:
        address = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def resolve(name: str) -> list[str]:
    """The addresses a DNS name resolves to (none if it does not)."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos]


def parse_networks(items: Sequence[str]) -> tuple[IpNetwork, ...]:
    """``--node-address-allow`` values as networks; ValueError names a bad one."""
    out = []
    for item in items:
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise ValueError(
                f"--node-address-allow {item!r} is not a network (write e.g. 10.0.0.0/8)"
            ) from exc
    return tuple(out)


@dataclass(frozen=True)
class EnrolmentPolicy:
    """How the server treats join-token enrolments and the addresses nodes give."""

    approve_new: bool = False
    address_allow: tuple[IpNetwork, ...] = ()
    resolver: Resolver = field(default=resolve, compare=False)

    def check_address(self, given: str, source: str | None) -> AddressVerdict:
        """Judge the address a node gives against its connection's ``source`` address."""
        if not given:
            return AddressVerdict.EMPTY
        literal = _ip(given)
        candidates = [literal] if literal is not None else [a for a in map(_ip, self.resolver(given)) if a]
        if not candidates:
            return AddressVerdict.REFUSED
        origin = _ip(source) if source else None
        if origin is not None and all(c == origin for c in candidates):
            return AddressVerdict.SOURCE
        if all(any(c in net for net in self.address_allow) for c in candidates):
            return AddressVerdict.ALLOWED
        return AddressVerdict.REFUSED
