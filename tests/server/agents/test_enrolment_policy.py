"""Which address a node may give for itself: its connection's source, an allowed network, or none."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fleetserve.server.agents.enrolment import AddressVerdict, EnrolmentPolicy, parse_networks

DNS = {"gpu-7.lab": ["10.0.0.7"], "split.lab": ["10.0.0.7", "10.0.0.8"]}


@dataclass(frozen=True)
class Case:
    id: str
    given: str
    source: str | None
    allow: tuple[str, ...]
    verdict: AddressVerdict


CASES = [
    Case("the source address itself", "10.0.0.7", "10.0.0.7", (), AddressVerdict.SOURCE),
    Case("an IPv4-mapped source", "10.0.0.7", "::ffff:10.0.0.7", (), AddressVerdict.SOURCE),
    Case("a bracketed IPv6 source", "[fd00::7]", "fd00::7", (), AddressVerdict.SOURCE),
    Case("another node's address", "10.0.0.8", "10.0.0.7", (), AddressVerdict.REFUSED),
    Case("loopback claimed from afar", "127.0.0.1", "10.0.0.7", (), AddressVerdict.REFUSED),
    Case("inside an allowed network", "192.168.1.9", "10.0.0.7", ("192.168.1.0/24",), AddressVerdict.ALLOWED),
    Case(
        "outside every allowed network",
        "192.168.2.9",
        "10.0.0.7",
        ("192.168.1.0/24",),
        AddressVerdict.REFUSED,
    ),
    Case("a DNS name resolving to the source", "gpu-7.lab", "10.0.0.7", (), AddressVerdict.SOURCE),
    Case("a DNS name resolving partly elsewhere", "split.lab", "10.0.0.7", (), AddressVerdict.REFUSED),
    Case("a name that does not resolve", "nowhere.lab", "10.0.0.7", (), AddressVerdict.REFUSED),
    Case("no address at all", "", "10.0.0.7", (), AddressVerdict.EMPTY),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_node_address_is_judged_against_its_source_and_the_allowed_networks(case: Case) -> None:
    policy = EnrolmentPolicy(
        address_allow=parse_networks(case.allow), resolver=lambda name: DNS.get(name, [])
    )
    assert policy.check_address(case.given, case.source) is case.verdict


def test_a_malformed_network_is_named() -> None:
    with pytest.raises(ValueError, match=r"--node-address-allow .10\.0\.0\.0/33. is not a network"):
        parse_networks(["10.0.0.0/33"])
