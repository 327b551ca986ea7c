"""What the autoscaler sees of a deployment, and how a serving process answers it: the engines'
load from its observer's scrapes, the requests its gateway holds, when its gateway last saw a
request. A reconciler thread asks directly (``autoscale_signals``); a reconciler process asks its
server over a pipe, answered by the same ``signal_answers``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fleetserve.autoscale import Signals, SignalsQuery, load_of
from fleetserve.gateway.picker import FRESH_SECONDS
from fleetserve.spec.resources import Deployment, Replica

if TYPE_CHECKING:
    from fleetserve.gateway.app import Gateway
    from fleetserve.server.observer import Observer

# What the autoscaler sees of a deployment: (deployment, its replicas, monotonic now) → signals.
SignalSource = Callable[[Deployment, list[Replica], float], Signals]


def signal_answers(observer: Observer, gateway: Gateway | None) -> Callable[[SignalsQuery], Signals]:
    """How this process answers the autoscaler: from its observer (engine metrics) and gateway."""

    def answer(query: SignalsQuery) -> Signals:
        fresh = []
        for name in query.ready:
            load = observer.loads.get(name)
            if load is not None and query.now - load.at <= FRESH_SECONDS:
                fresh.append(load_of(query.metric, load.running, load.waiting))
        held = gateway.admission.depth(query.deployment).waiting if gateway is not None else 0
        last = gateway.last_request.get(query.deployment) if gateway is not None else None
        return Signals(query.deployment, len(query.ready), query.total, tuple(fresh), held, last)

    return answer


def autoscale_signals(observer: Observer, gateway: Gateway | None) -> SignalSource:
    """What the autoscaler sees, asked of this process's observer and gateway directly."""
    answer = signal_answers(observer, gateway)
    return lambda dep, replicas, now: answer(SignalsQuery.of(dep, replicas, now))
