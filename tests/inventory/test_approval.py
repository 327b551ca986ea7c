"""A node's claimed hardware judged against what an operator approved (``inventory.approval``):
more of anything, or another device class, is held; less is accepted; the cap keeps placement to
the approved facts."""

from __future__ import annotations

import pytest

from builders import GiB, cpu_8c_32g, gpu_host_8c_64g, node, nvidia_h100_80gb_x8
from fleetserve.inventory.approval import Difference, Fact, Hardware, Verdict, cap, judge
from fleetserve.spec.resources import Node

APPROVED = Hardware.of(gpu_host_8c_64g("n1", "h100", 2))  # 8 cores, 64 GiB, 2 h100


@pytest.mark.parametrize(
    ("claim", "verdict", "differences"),
    [
        pytest.param(gpu_host_8c_64g("n1", "h100", 2), Verdict.SAME, (), id="the approved facts"),
        pytest.param(
            node("n1", 1000, "64GiB", groups=[("h100", 2)]),
            Verdict.MORE,
            (Difference(Fact.CORES, 1000, 8),),
            id="1000 cores",
        ),
        pytest.param(
            node("n1", 8, "65GiB", groups=[("h100", 2)]),
            Verdict.MORE,
            (Difference(Fact.MEMORY, 65 * GiB, 64 * GiB),),
            id="a GiB more memory",
        ),
        pytest.param(
            gpu_host_8c_64g("n1", "h100", 3),
            Verdict.MORE,
            (Difference(Fact.DEVICES, 3, 2, "h100"),),
            id="a device more",
        ),
        pytest.param(
            gpu_host_8c_64g("n1", "b200", 2),
            Verdict.MORE,
            (Difference(Fact.DEVICES, 2, 0, "b200"), Difference(Fact.DEVICES, 0, 2, "h100")),
            id="another device class, as many",
        ),
        pytest.param(
            node("n1", 4, "64GiB", groups=[("h100", 2), ("l4", 1)]),
            Verdict.MORE,
            (Difference(Fact.CORES, 4, 8), Difference(Fact.DEVICES, 1, 0, "l4")),
            id="fewer cores but a new class: held",
        ),
        pytest.param(
            node("n1", 4, "32GiB", groups=[("h100", 1)]),
            Verdict.LESS,
            (
                Difference(Fact.CORES, 4, 8),
                Difference(Fact.MEMORY, 32 * GiB, 64 * GiB),
                Difference(Fact.DEVICES, 1, 2, "h100"),
            ),
            id="less of everything",
        ),
        pytest.param(
            node("n1", 8, "64GiB"),
            Verdict.LESS,
            (Difference(Fact.DEVICES, 0, 2, "h100"),),
            id="every device gone",
        ),
    ],
)
def test_a_claim_is_held_when_it_exceeds_the_approval_in_any_fact_and_accepted_when_less(
    claim: Node, verdict: Verdict, differences: tuple[Difference, ...]
) -> None:
    judged = judge(Hardware.of(claim), APPROVED)
    assert (judged.verdict, judged.differences) == (verdict, differences)
    assert judged.excess == tuple(d for d in differences if d.claimed > d.approved)


def test_the_judgement_says_what_exceeds_the_approval() -> None:
    judged = judge(Hardware.of(node("n1", 1000, "64GiB", groups=[("b200", 1), ("h100", 2)])), APPROVED)
    assert judged.describe() == "cores 1000 (approved 8); devices of class b200 1 (approved 0)"
    less = judge(Hardware.of(node("n1", 8, "32GiB", groups=[("h100", 2)])), APPROVED)
    assert less.describe() == "memory 32.0GiB (approved 64.0GiB)"


def test_hardware_counts_devices_per_class_and_describes_itself() -> None:
    facts = Hardware.of(node("n1", 16, "64GiB", groups=[("h100", 2), ("a100", 3)]))
    assert facts == Hardware(cores=16, memory=64 * GiB, devices={"a100": 3, "h100": 2})
    assert facts.describe() == "16 cores, 64.0GiB, 3 a100, 2 h100"
    assert Hardware.of(cpu_8c_32g("c")).describe() == "8 cores, 32.0GiB"


def test_the_cap_cuts_a_claim_down_to_the_approved_facts() -> None:
    approved = Hardware(cores=16, memory=64 * GiB, devices={"h100": 4})
    claim = nvidia_h100_80gb_x8("n1").model_copy(
        update={"cpu": cpu_8c_32g("x").cpu.model_copy(update={"cores": 1000})}
    )

    placed = cap(claim, approved)

    assert Hardware.of(placed) == Hardware(cores=16, memory=32 * GiB, devices={"h100": 4})
    assert [d.index for d in placed.devices] == [0, 1, 2, 3]  # the lowest-numbered of the class
    assert placed.nvlink_domains == ((0, 1, 2, 3),)  # narrowed to the devices kept
    assert judge(Hardware.of(placed), approved).verdict is not Verdict.MORE
    Node.model_validate(placed.model_dump(mode="json", by_alias=True))  # still a valid node


def test_the_cap_drops_devices_of_a_class_not_approved_and_keeps_a_claim_within_the_approval() -> None:
    placed = cap(gpu_host_8c_64g("n1", "b200", 2), APPROVED)
    assert (placed.devices, placed.cpu.cores) == ((), 8)
    within = node("n1", 4, "32GiB", groups=[("h100", 1)], labels={"rack": "r1"})
    assert cap(within, APPROVED) == within
