"""A status report as the store takes it (``store.reports.AgentReport``), and the one check the
store cannot make: a node reports samples of its own GPUs only."""

from __future__ import annotations

from datetime import datetime

from fleetserve.errors import Problem, UnknownNode
from fleetserve.protocol import AgentStatus, StatusReport
from fleetserve.server.agents.refusals import Reason, Refusal
from fleetserve.store.protocols import AgentCalls
from fleetserve.store.reports import AgentReport

# Problems named in a refusal of GPU samples: enough to name the fault.
MAX_NAMED = 10


def gpu_refusal(store: AgentCalls, report: StatusReport) -> Refusal | None:
    """The refusal (422, naming each sample) of GPU samples that are not of the reporting node's
    own devices, or (404) of a node not registered; None when every sample is its own."""
    if not report.gpu_metrics:
        return None
    try:
        devices = {str(d.index) for d in store.get_node(report.node).devices}
    except UnknownNode:
        return Refusal(Reason.UNKNOWN_NODE, {"node": report.node})
    problems = []
    for i, sample in enumerate(report.gpu_metrics):
        node, device = sample.labels.get("node"), sample.labels.get("device")
        if node != report.node:
            why = f"{node!r} is not the reporting node {report.node!r}"
            problems.append(Problem("StatusReport", f"gpuMetrics[{i}].labels.node", why))
        elif device not in devices:
            why = f"{device!r} is not a device of node {report.node}"
            problems.append(Problem("StatusReport", f"gpuMetrics[{i}].labels.device", why))
        if len(problems) >= MAX_NAMED:
            break
    if not problems:
        return None
    return Refusal(Reason.INVALID_DOCUMENT, {"count": len(problems)}, problems)


def agent_report(report: StatusReport, now: datetime, credential: str | None) -> AgentReport:
    """A status report as the store takes it, received at ``now`` with ``credential``."""
    return AgentReport(
        node=report.node,
        epoch=report.epoch,
        replicas={name: (r.state, r.status()) for name, r in report.replicas.items()},
        model_cache=report.model_cache,
        agent_status=AgentStatus(
            downloads=report.downloads,
            problems=report.problems,
            gpuMetrics=report.gpu_metrics,
            reportedAt=now.isoformat(),
        ),
        credential=credential,
    )
