"""What agents report, over SQL: heartbeats and epochs (fencing), each node's assignments, the
replicas' reported states and typed statuses (``protocol.ReplicaStatus``), each node's agent
status (``protocol.AgentStatus``), and the replicas' endpoints.

A status report is written only where the agents' accepted-call rule accepts it (its statements'
WHERE is ``acceptance.accepts``); a refused one writes nothing, and the rule's verdict says why.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import (
    JSON,
    Connection,
    Update,
    bindparam,
    case,
    cast,
    func,
    select,
    update,
)

from fleetserve.errors import (
    StaleEpoch,
    UnknownNode,
    UnknownReplica,
)
from fleetserve.protocol import AgentStatus, ReplicaStatus
from fleetserve.reconcile.health import Transition, least_healthy
from fleetserve.routing import ReplicaEndpoint
from fleetserve.spec.resources import (
    NodeState,
    Replica,
    ReplicaState,
)
from fleetserve.store.acceptance import (
    HEARD,
    Claim,
    Judgement,
    Verdict,
    accepts,
    array_values,
    claim_arrays,
    claim_values,
    credential_hash,
    judge,
    locked_nodes,
    one_claim,
)
from fleetserve.store.base import IN_CHUNK, SqlBase, as_text, move_node, replica_of
from fleetserve.store.tables import (
    DeploymentRow,
    DeviceClassRow,
    FleetChangeRow,
    ModelRow,
    NodeRow,
    ReplicaRow,
    ReplicaShardRow,
    stamp,
)


@dataclass(frozen=True)
class NodeHeartbeat:
    """When a node's agent was last heard from, with the node's state and epoch."""

    name: str
    state: NodeState
    epoch: int
    last_heartbeat: datetime | None


@dataclass(frozen=True)
class AssignmentInputs:
    """What every node's assignments are built from, read in one transaction: enough to tell,
    without building them, whether a node's assignments may have changed (``server.assignwatch``).

    A replica's document never changes once allocated (its state is not part of an assignment's
    revision), an address changes only with a registration (which bumps the epoch), and an
    engine key never changes: so the replicas on a node, their deployments' specs, the epochs of
    their nodes, and the models and classes cover everything an assignment holds."""

    shards: tuple[tuple[str, str, str], ...]  # (replica, node, deployment), one per shard
    epochs: Mapping[str, int]  # per registered node
    deployments: Mapping[str, str]  # per deployment, its spec as canonical JSON
    shared: str  # every model and device class, as canonical JSON


DRAINING = ReplicaState.DRAINING.value


def _canonical(rows: Sequence[tuple[str, object]]) -> str:
    return json.dumps(sorted(rows), sort_keys=True, separators=(",", ":"))


# A status report's node write, built once per shape (building one cost about as much CPU as
# running it): the heartbeat, with or without the agent's status, where the rule accepts the
# report's claim (``acceptance.accepts``), with or without a credential to check; only the cached
# models read back, not the node's hardware document.
_AT = bindparam("b_at", type_=NodeRow.last_heartbeat.type)
_AGENT = bindparam("b_agent", type_=NodeRow.agent_status.type)
_REPORT_BEAT = {
    (credential, status): update(NodeRow)
    .where(accepts(one_claim(credential)))
    .values(last_heartbeat=_AT, **HEARD, **({"agent_status": _AGENT} if status else {}))
    .returning(NodeRow.spec["modelCache"])
    for credential in (True, False)
    for status in (True, False)
}
# A heartbeat the server records for itself (a registration: no claim to judge).
_HEARD = update(NodeRow).where(NodeRow.name == bindparam("b_node")).values(last_heartbeat=_AT)


def _beat_nodes_statement(credential: bool) -> Update:
    """The node writes of many reports with their agents' status in one statement, on PostgreSQL:
    the batch goes as arrays (``acceptance.claim_arrays``), so the statement is built and compiled
    once. (Built per batch with a VALUES list of its rows, it made thousands of SQL-expression
    objects in reference cycles per batch, and compiled again for every batch size: at 1,000
    agents the collector's passes over that garbage stalled the server for 50 to 300 ms.) The
    nodes are locked in name order first (``acceptance.locked_nodes``)."""
    claims, claim = claim_arrays(credential, "agent")
    locked = locked_nodes()
    hashes = [claims.c.credential] if credential else []
    return (
        update(NodeRow)
        .where(NodeRow.name == locked.c.name, accepts(claim))
        .values(last_heartbeat=_AT, agent_status=cast(claims.c.agent, JSON), **HEARD)
        .returning(NodeRow.name, NodeRow.epoch, NodeRow.spec["modelCache"], *hashes)
    )


_BEAT_NODES = {credential: _beat_nodes_statement(credential) for credential in (True, False)}
# A replica's reported state and status; Draining is the control plane's word: an agent's report
# never undoes it.
_REPLICA_REPORTED = (
    update(ReplicaRow)
    .where(ReplicaRow.name == bindparam("b_name"))
    .values(
        status=bindparam("b_status", type_=ReplicaRow.__table__.c.status.type),
        state=case((ReplicaRow.state == DRAINING, ReplicaRow.state), else_=bindparam("b_state")),
    )
)
# Per node of a batch of reports, its replicas as stored (a replica of several nodes once per node).
_REPLICAS_ON_NODES = (
    select(ReplicaShardRow.node, ReplicaRow.name, ReplicaRow.state, ReplicaRow.status)
    .join(ReplicaRow, ReplicaRow.name == ReplicaShardRow.replica)
    .where(ReplicaShardRow.node.in_(bindparam("b_nodes", expanding=True)))
)


@dataclass(frozen=True)
class AgentReport:
    """One agent's status report as the store takes it: its node and registration, its replicas'
    states and statuses, its model cache (None: not reported) and the rest of what it reports."""

    node: str
    epoch: int
    replicas: Mapping[str, tuple[ReplicaState, ReplicaStatus]]
    model_cache: Sequence[str] | None = None
    agent_status: AgentStatus | None = None
    credential: str | None = None  # the credential it came with (None: the server's own call)

    @property
    def claim(self) -> Claim:
        """What the report claims, for the rule (``acceptance``)."""
        return Claim(self.credential, self.node, self.epoch)


def refused(judged: Judgement, node: str) -> StaleEpoch | UnknownNode:
    """A call the rule refused, as the store's error for an in-process caller."""
    if judged.verdict is Verdict.UNKNOWN_NODE:
        return UnknownNode(f"no node named {node!r} is registered")
    return StaleEpoch(f"node {node}: {judged.verdict.value} (register again)")


def _written_key(r: AgentReport) -> tuple[str, int, str | None]:
    return (r.node, r.epoch, None if r.credential is None else credential_hash(r.credential))


class SqlReports(SqlBase):
    """Heartbeats, assignments and the agents' status reports, over SQL."""

    def heartbeat(self, name: str, now: datetime, epoch: int | None = None) -> None:
        """Record that the node's agent was heard from at ``now``; raises UnknownNode, and
        StaleEpoch when ``epoch`` is given and the rule refuses it (``acceptance``)."""
        if epoch is not None:
            (stop,) = self._reports([AgentReport(name, epoch, {})], now)
            if isinstance(stop, Judgement):
                raise refused(stop, name)
            return
        with self._single(f"recording a heartbeat of node {name}", write=True) as c:
            if (
                c.execute(_HEARD.returning(NodeRow.name), {"b_node": name, "b_at": stamp(now)}).first()
                is None
            ):
                raise UnknownNode(f"no node named {name!r} is registered")

    def judge(self, claims: Sequence[Claim]) -> list[Judgement]:
        """The rule's verdict on each call, as the rows stand (``acceptance``): one read."""
        with self._single("judging agents' calls", write=False) as c:
            return judge(c, claims, postgres=self._postgres)

    def assignments(self, node: str) -> list[Replica]:
        """The replicas with a shard on ``node``, by name: what its agent must run."""
        with self._read(f"listing the assignments of node {node}") as s:
            names = select(ReplicaShardRow.replica).where(ReplicaShardRow.node == node)
            rows = s.scalars(select(ReplicaRow).where(ReplicaRow.name.in_(names)))
            return sorted((replica_of(r.spec, r.state) for r in rows), key=lambda r: r.name)

    def fleet_changes(self) -> int:
        """The change counter (``changegate``): it moves with every committed write that changes
        replicas, their reported ports or restarts, nodes' states, cordons, epochs or documents,
        deployments' specs, models, classes or fabrics; never with a heartbeat. One tiny read."""
        with self._single("reading the change counter", write=False) as c:
            return int(c.execute(select(func.coalesce(func.sum(FleetChangeRow.n), 0))).scalar_one())

    def assignment_inputs(self) -> AssignmentInputs:
        """Everything every node's assignments are built from, in one read (no document parsed)."""
        with self._read("reading what assignments are built from") as s:
            shards = s.execute(
                select(ReplicaShardRow.replica, ReplicaShardRow.node, ReplicaRow.deployment).join(
                    ReplicaRow, ReplicaRow.name == ReplicaShardRow.replica
                )
            )
            shard_rows = tuple((replica, node, dep) for replica, node, dep in shards)
            epochs = {name: epoch for name, epoch in s.execute(select(NodeRow.name, NodeRow.epoch))}
            deployments = {
                name: json.dumps(spec, sort_keys=True, separators=(",", ":"))
                for name, spec in s.execute(select(DeploymentRow.name, DeploymentRow.spec))
            }
            models = [(name, spec) for name, spec in s.execute(select(ModelRow.name, ModelRow.spec))]
            classes = [
                (name, spec) for name, spec in s.execute(select(DeviceClassRow.name, DeviceClassRow.spec))
            ]
        return AssignmentInputs(shard_rows, epochs, deployments, _canonical(models) + _canonical(classes))

    def report(
        self,
        node: str,
        epoch: int,
        now: datetime,
        replicas: Mapping[str, tuple[ReplicaState, ReplicaStatus]],
        model_cache: Sequence[str] | None = None,
        agent_status: AgentStatus | None = None,
    ) -> list[str]:
        """An agent's status report, in one transaction: the states of its replicas (only those
        assigned to it), its model cache (placement prefers nodes holding a model) and anything
        else it reports; also a heartbeat. Returns the reported names not assigned to the node —
        the agent must stop those. Raises StaleEpoch for an old registration, UnknownNode."""
        (stop,) = self._reports([AgentReport(node, epoch, replicas, model_cache, agent_status)], now)
        if isinstance(stop, Judgement):
            raise refused(stop, node)
        return stop

    def reports(self, batch: Sequence[AgentReport], now: datetime) -> list[list[str] | None]:
        """``judge_reports``, with None where a report was refused."""
        return [None if isinstance(r, Judgement) else r for r in self._reports(batch, now)]

    def judge_reports(self, batch: Sequence[AgentReport], now: datetime) -> list[list[str] | Judgement]:
        """Many agents' status reports in one transaction (``server/agents/batching.py`` gathers
        them); per report, what ``report`` returns, or the rule's verdict where it refused it
        (``acceptance``): nothing of that one is written. Each is accepted or not on its own node's
        row, as if it came alone."""
        return self._reports(batch, now)

    def _reports(self, batch: Sequence[AgentReport], now: datetime) -> list[list[str] | Judgement]:
        when = stamp(now)
        out: list[list[str] | Judgement] = [[] for _ in batch]
        if not batch:
            return out
        action = (
            f"recording a status report of node {batch[0].node}"
            if len(batch) == 1
            else f"recording {len(batch)} status reports"
        )
        with self._write(action) as s:
            conn = s.connection()
            accepted = []
            # Many reports with their agents' status, on PostgreSQL: every node's check and write
            # in one statement (a round trip per report cost more than the rest of the batch; on
            # SQLite, in process, a statement is no round trip).
            together = (
                {i for i, r in enumerate(batch) if r.agent_status is not None} if self._postgres else set()
            )
            written = self._beat_nodes(conn, [batch[i] for i in sorted(together)], when) if together else {}
            # Nodes' rows locked in one order (by name) whatever order the reports came in.
            for i in sorted(range(len(batch)), key=lambda i: batch[i].node):
                r = batch[i]
                values = {**claim_values(r.claim), "b_at": when}
                if r.agent_status is not None:
                    values["b_agent"] = r.agent_status.stored()
                statement = _REPORT_BEAT[(r.credential is not None, r.agent_status is not None)]
                if i in together:
                    found = written.get(_written_key(r))
                else:
                    found = conn.execute(statement, values).first()
                if found is None:
                    # Refused: the verdict, as the row stands (locked); one that passes now moved
                    # under us, and is written with its lock held.
                    (judged,) = judge(conn, [r.claim], postgres=self._postgres, lock=True)
                    if not judged.accepted:
                        out[i] = judged
                        continue
                    found = conn.execute(statement, values).first()
                    assert found is not None  # judged accepted with its row locked
                cached = found[0]
                accepted.append(i)
                if r.model_cache is not None and cached != sorted(set(r.model_cache)):
                    row = self._locked_node(s, r.node)
                    row.spec = {**row.spec, "modelCache": sorted(set(r.model_cache))}
            # The nodes' replicas as stored: only a state or status that changed is written.
            nodes = sorted({batch[i].node for i in accepted})
            stored: dict[str, dict[str, tuple[str, dict[str, object] | None]]] = {n: {} for n in nodes}
            for j in range(0, len(nodes), IN_CHUNK):
                for node, name, state, status in conn.execute(
                    _REPLICAS_ON_NODES, {"b_nodes": nodes[j : j + IN_CHUNK]}
                ):
                    stored[node][name] = (state, status)
            heard: set[str] = set()
            changed: dict[str, dict[str, object]] = {}
            for i in sorted(accepted):  # as they came: a later report of a replica wins
                r, mine = batch[i], stored[batch[i].node]
                for name in set(r.replicas) & set(mine):
                    heard.add(name)
                    state, status = r.replicas[name]
                    new_state, new_status = ReplicaState(state).value, status.stored()
                    old_state, old_status = mine[name]
                    if (old_status or {}) != new_status or old_state not in (new_state, DRAINING):
                        changed[name] = {"b_name": name, "b_status": new_status, "b_state": new_state}
                    else:
                        changed.pop(name, None)
                out[i] = sorted(set(r.replicas) - set(mine))
            names = sorted(heard)
            for j in range(0, len(names), IN_CHUNK):
                conn.execute(
                    update(ReplicaRow)
                    .where(ReplicaRow.name.in_(names[j : j + IN_CHUNK]))
                    .values(reported_at=when)
                )
            if changed:  # one statement, executed for each (psycopg sends them in one pipeline)
                conn.execute(_REPLICA_REPORTED, [changed[name] for name in sorted(changed)])
        return out

    def _beat_nodes(
        self, conn: Connection, reports: Sequence[AgentReport], when: datetime
    ) -> dict[tuple[str, int, str | None], tuple[object]]:
        """The node writes of ``reports`` (each with its agent's status) in one statement per
        shape (``_BEAT_NODES``: with credentials, without): each node the rule accepts the report
        of gets the heartbeat and the status (of its last report in the batch); per (node, epoch,
        credential hash) written, its cached models."""
        out: dict[tuple[str, int, str | None], tuple[object]] = {}
        for credential in (True, False):
            last: dict[tuple[str, int, str | None], AgentReport] = {}
            for r in reports:
                if (r.credential is not None) is credential:
                    last[_written_key(r)] = r
            if not last:
                continue
            batch = [last[key] for key in sorted(last, key=lambda k: (k[0], k[1], k[2] or ""))]
            arguments = {
                **array_values([r.claim for r in batch], credential),
                "b_at": when,
                "b_agent": [json.dumps(r.agent_status.stored() if r.agent_status else {}) for r in batch],
            }
            for row in conn.execute(_BEAT_NODES[credential], arguments):
                out[(row[0], row[1], row[3] if credential else None)] = (row[2],)
        return out

    def replica_status(self, name: str) -> ReplicaStatus:
        """What the agent last reported about a replica (message, restarts, stderr tail)."""
        with self._read(f"reading replica {name}") as s:
            row = s.get(ReplicaRow, name)
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            return ReplicaStatus.model_validate(row.status or {})

    def agent_statuses(self) -> dict[str, AgentStatus]:
        """Every node's last agent report beyond replica states, in one read."""
        with self._read("reading the agents' reports") as s:
            rows = s.execute(select(NodeRow.name, as_text(NodeRow.agent_status)))
            return self._agent_statuses.parse_all((name, status) for name, status in rows)

    def agent_status(self, node: str) -> AgentStatus:
        """What the node's agent last reported beyond replica states (downloads, problems)."""
        with self._read(f"reading node {node}") as s:
            row = s.get(NodeRow, node)
            if row is None:
                raise UnknownNode(f"no node named {node!r} is registered")
            return AgentStatus.model_validate(row.agent_status or {})

    def node_heartbeats(self) -> list[NodeHeartbeat]:
        """Every node's state, epoch and last heartbeat (None if never heard), by name."""
        with self._read("listing heartbeats") as s:
            rows = s.execute(select(NodeRow.name, NodeRow.state, NodeRow.epoch, NodeRow.last_heartbeat))
            out = [NodeHeartbeat(name, NodeState(state), epoch, last) for name, state, epoch, last in rows]
        return sorted(out, key=lambda h: h.name)

    def mark_silent(self, changes: Sequence[Transition]) -> list[str]:
        """Move each node its silence judged (``old`` to ``new``), in one transaction, and return
        the nodes moved. A node whose state is no longer ``old``, or that was heard after the
        heartbeat its judgement saw (``heard``: a heartbeat committed between the reconciler's read
        and this write), is left as it is; so is one whose row another writer holds locked
        (PostgreSQL's ``SKIP LOCKED``): a heartbeat being written for it, or a server stopped in the
        middle of that write. The liveness judgement never waits on another process's transaction;
        a node skipped is judged again next cycle."""
        if not changes:
            return []
        wanted = {c.node: c for c in changes}
        moved = []
        with self._write(f"marking {len(wanted)} silent node(s)") as s:
            rows = s.scalars(
                select(NodeRow).where(NodeRow.name.in_(list(wanted))).with_for_update(skip_locked=True)
            )
            for row in rows:
                change = wanted[row.name]
                heard_since = (
                    change.heard is not None
                    and row.last_heartbeat is not None
                    and row.last_heartbeat > stamp(change.heard)
                )
                if row.state != change.old.value or heard_since:
                    continue
                move_node(row, change.new)
                moved.append(row.name)
        return sorted(moved)

    def engine_keys(self, replicas: Sequence[str]) -> dict[str, str]:
        """The engine API keys of ``replicas`` (those that have one): for their agents' assignments."""
        with self._read("reading engine keys") as s:
            rows = s.execute(
                select(ReplicaRow.name, ReplicaRow.engine_key).where(ReplicaRow.name.in_(list(replicas)))
            )
            return {name: key for name, key in rows if key}

    def replica_endpoints(self) -> list[ReplicaEndpoint]:
        """Every replica with the address of its first shard's node, its reported status and the
        state of its least healthy node (a node no longer stored counts as Lost)."""
        with self._read("listing replica endpoints") as s:
            # Only the columns routes need (not every node's hardware document), and replica
            # documents parsed once per allocation (``doccache``): read every second.
            address = NodeRow.spec["address"].as_string()
            nodes = {
                name: (addr or "", NodeState(state))
                for name, state, addr in s.execute(select(NodeRow.name, NodeRow.state, address))
            }
            rows = s.execute(
                select(
                    ReplicaRow.name,
                    ReplicaRow.engine_key,
                    ReplicaRow.state,
                    as_text(ReplicaRow.status).label("status"),
                )
            ).all()
            docs = self._replicas_of(s, [(r.name, r.engine_key, r.state) for r in rows])
        statuses = self._statuses.parse_all((r.name, r.status) for r in rows)
        out = []
        for row in rows:
            replica = docs[row.name]
            first = nodes.get(replica.shards[0].node, ("", NodeState.LOST))[0]
            states = [nodes.get(shard.node, ("", NodeState.LOST))[1] for shard in replica.shards]
            out.append(
                ReplicaEndpoint(replica, first, statuses[row.name], row.engine_key, least_healthy(states))
            )
        return sorted(out, key=lambda e: e.replica.name)
