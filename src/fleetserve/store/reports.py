"""What agents report, over SQL: heartbeats and epochs (fencing), each node's assignments, the
replicas' reported states and typed statuses (``protocol.ReplicaStatus``), each node's agent
status (``protocol.AgentStatus``), and the replicas' endpoints.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import (
    Connection,
    bindparam,
    case,
    func,
    select,
    text,
    update,
)

from fleetserve.errors import (
    StaleEpoch,
    UnknownNode,
    UnknownReplica,
)
from fleetserve.protocol import AgentStatus, ReplicaStatus
from fleetserve.reconcile.health import least_healthy
from fleetserve.routing import ReplicaEndpoint
from fleetserve.spec.resources import (
    NodeState,
    Replica,
    ReplicaState,
)
from fleetserve.store.base import IN_CHUNK, SqlBase, as_text, replica_of
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


# A status report's statements, built once (building one cost about as much CPU as running it):
# the node's heartbeat with its check, with and without the agent's status, and the node's
# replicas as stored.
_REPORT_ACCEPTS = update(NodeRow).where(
    NodeRow.name == bindparam("b_node"),
    NodeRow.epoch == bindparam("b_epoch"),
    NodeRow.state == NodeState.READY.value,
)
_REPORT_BEAT = _REPORT_ACCEPTS.values(
    last_heartbeat=bindparam("b_at", type_=NodeRow.last_heartbeat.type)
).returning(NodeRow.spec["modelCache"])
_REPORT_BEAT_STATUS = _REPORT_ACCEPTS.values(
    last_heartbeat=bindparam("b_at", type_=NodeRow.last_heartbeat.type),
    agent_status=bindparam("b_agent", type_=NodeRow.agent_status.type),
).returning(NodeRow.spec["modelCache"])
# The node writes of many reports with their agents' status in one statement, on PostgreSQL
# (``_beat_nodes``): the batch goes as three arrays, so the statement is built and compiled once.
# (Built per batch with a VALUES list of its rows, it made thousands of SQL-expression objects in
# reference cycles per batch, and compiled again for every batch size: at 1,000 agents the
# collector's passes over that garbage stalled the server for 50 to 300 ms.) The nodes are locked
# in name order first, as every writer of several nodes locks them (``identity._BEAT_LOCKS``): the
# join alone would lock them in the order it meets them.
_BEAT_NODES = text(
    f"""
    UPDATE {NodeRow.__tablename__} AS n
    SET last_heartbeat = :b_at, agent_status = CAST(reported.agent AS JSON)
    FROM unnest(CAST(:b_nodes AS TEXT[]), CAST(:b_epochs AS INTEGER[]), CAST(:b_agents AS TEXT[]))
             AS reported (node, epoch, agent),
         (SELECT name FROM {NodeRow.__tablename__}
          WHERE name = ANY(CAST(:b_nodes AS TEXT[])) ORDER BY name FOR UPDATE) AS locked
    WHERE n.name = locked.name AND n.name = reported.node AND n.epoch = reported.epoch
      AND n.state = :b_ready
    RETURNING n.name, n.epoch, n.spec -> 'modelCache'
    """
)
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


class SqlReports(SqlBase):
    """Heartbeats, assignments and the agents' status reports, over SQL."""

    def heartbeat(self, name: str, now: datetime, epoch: int | None = None) -> None:
        """Record that the node's agent was heard from at ``now``; raises UnknownNode, and
        StaleEpoch when ``epoch`` is given and is not the node's current registration."""
        when = stamp(now)
        # The common case in one statement: the check and the write together, atomic.
        accepted = [NodeRow.name == name]
        if epoch is not None:
            accepted += [NodeRow.epoch == epoch, NodeRow.state == NodeState.READY.value]
        beat = update(NodeRow).where(*accepted).values(last_heartbeat=when).returning(NodeRow.name)
        with self._single(f"recording a heartbeat of node {name}", write=True) as c:
            if c.execute(beat).first() is not None:
                return
        # Refused: the reason, read and checked as it stands now.
        with self._write(f"recording a heartbeat of node {name}") as s:
            # The columns the check needs, not the node's hardware document: the most frequent call.
            found = s.execute(select(NodeRow.epoch, NodeRow.state).where(NodeRow.name == name)).one_or_none()
            if found is None:
                raise UnknownNode(f"no node named {name!r} is registered")
            self._check_epoch(name, found.epoch, found.state, epoch)
            s.connection().execute(update(NodeRow).where(NodeRow.name == name).values(last_heartbeat=when))

    @staticmethod
    def _check_epoch(name: str, current: int, state: str, epoch: int | None) -> None:
        if epoch is None:
            return
        if epoch != current:
            # The message never names the current epoch: it is the node's to know, not a caller's.
            raise StaleEpoch(
                f"node {name} registered again since this registration; "
                "register again and stop every replica not assigned"
            )
        if state != NodeState.READY.value:
            # Judged NotReady or Lost while silent: only a registration brings it back, and tells
            # the agent which of its replicas were moved away meanwhile.
            raise StaleEpoch(f"node {name} was marked {state} while silent; register again")

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
        stop = self._reports(
            [AgentReport(node, epoch, replicas, model_cache, agent_status)], now, explain=True
        )[0]
        assert stop is not None  # explained: refused ones raise
        return stop

    def reports(self, batch: Sequence[AgentReport], now: datetime) -> list[list[str] | None]:
        """Many agents' status reports in one transaction (``server/agents/batching.py`` gathers them);
        per report, what ``report`` returns, or None where it was not accepted (a stale epoch, a
        node not Ready or unknown): nothing of that one is written, and ``report`` says why.
        Each is accepted or not on its own node's row, as if it came alone."""
        return self._reports(batch, now, explain=False)

    def _reports(
        self, batch: Sequence[AgentReport], now: datetime, *, explain: bool
    ) -> list[list[str] | None]:
        when = stamp(now)
        out: list[list[str] | None] = [None] * len(batch)
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
                [i for i, r in enumerate(batch) if r.agent_status is not None]
                if self._postgres and not explain
                else []
            )
            written = self._beat_nodes(conn, [batch[i] for i in together], when) if together else {}
            # Nodes' rows locked in one order (by name) whatever order the reports came in.
            for i in sorted(range(len(batch)), key=lambda i: batch[i].node):
                r = batch[i]
                # The check and the node's write in one statement (it locks the row, as allocation
                # does); only the cached models read back, not the node's hardware document.
                values: dict[str, object] = {"b_node": r.node, "b_epoch": r.epoch, "b_at": when}
                if together:
                    found = written.get((r.node, r.epoch)) if r.agent_status is not None else None
                    if found is None and r.agent_status is None:
                        found = conn.execute(_REPORT_BEAT, values).first()
                elif r.agent_status is None:
                    found = conn.execute(_REPORT_BEAT, values).first()
                else:
                    found = conn.execute(
                        _REPORT_BEAT_STATUS, {**values, "b_agent": r.agent_status.stored()}
                    ).first()
                if found is not None:
                    cached = found[0]
                elif explain:
                    # Refused: the reason, as the row stands (it raises; a row that passes now
                    # moved under us, and is checked and written with its lock held).
                    row = self._locked_node(s, r.node)
                    self._check_epoch(row.name, row.epoch, row.state, r.epoch)
                    row.last_heartbeat = when
                    if r.agent_status is not None:
                        row.agent_status = r.agent_status.stored()
                    s.flush()
                    cached = row.spec.get("modelCache")
                else:
                    continue
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
    ) -> dict[tuple[str, int], tuple[object]]:
        """The node writes of ``reports`` (each with its agent's status) in one statement
        (PostgreSQL: ``UPDATE … FROM unnest(arrays)``, ``_BEAT_NODES``): each
        node whose epoch is the one its report gives, while Ready, gets the heartbeat and the
        status (of its last report in the batch); per (node, epoch) written, its cached models."""
        last: dict[tuple[str, int], AgentReport] = {}
        for r in reports:
            last[(r.node, r.epoch)] = r
        batch = sorted(last.items())
        arguments = {
            "b_at": when,
            "b_ready": NodeState.READY.value,
            "b_nodes": [node for (node, _), _r in batch],
            "b_epochs": [epoch for (_, epoch), _r in batch],
            "b_agents": [json.dumps(r.agent_status.stored() if r.agent_status else {}) for _, r in batch],
        }
        return {(name, epoch): (cached,) for name, epoch, cached in conn.execute(_BEAT_NODES, arguments)}

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
