"""A node's assignment set: what its agent must run (``protocol.AssignmentSet``), built from the
store's documents, with the revision that changes exactly when the set or a spec does.

Used by the registration (its answer carries the set) and by the assignments poll of the agents'
door (``door.py``). Reads only what the node's replicas name, through ``AssignmentReads``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

from fleetserve.engines.registry import weights_for
from fleetserve.errors import InternalError, NotFound
from fleetserve.protocol import Assignment, AssignmentSet
from fleetserve.spec.resources import Deployment, Model, Replica
from fleetserve.store.protocols import AssignmentReads
from fleetserve.validation import resolve_profile


def _doc(resource: BaseModel) -> dict[str, Any]:
    return resource.model_dump(mode="json", by_alias=True)


def revision_of(assignments: list[Assignment], keep: list[str] | None = None) -> str:
    """A short digest of an assignment set: it changes exactly when the set or a spec changes
    (not when a replica's state does)."""
    entries = [_doc(a) for a in assignments]
    stable = [{**e, "replica": {**e["replica"], "state": None}} for e in entries]
    if keep:
        stable.append({"keep": sorted(keep)})
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


def kept(replicas: list[Replica], entries: list[Assignment]) -> list[str]:
    """The node's replicas with no assignment entry (their deployment is gone): kept while they
    drain, never started."""
    built = {e.replica.name for e in entries}
    return sorted(r.name for r in replicas if r.name not in built)


def assignment_entries(store: AssignmentReads, replicas: list[Replica]) -> list[Assignment]:
    """What an agent needs to run each replica: the replica, its profile with the runtime variant
    worked out, the weights its engine serves (``weights_for``), the addresses of the replica's
    nodes (shard order) and its engine's API key. Reads only what these replicas name: the
    classes, their nodes, their deployments and models (each once), never the whole fleet."""
    if not replicas:
        return []
    classes = store.device_classes()
    addresses = store.node_addresses([s.node for r in replicas for s in r.shards])
    keys = store.engine_keys([r.name for r in replicas])
    deployments: dict[str, Deployment | None] = {}
    models: dict[str, Model | None] = {}
    adapter_docs: dict[str, Model | None] = {}
    out = []
    for replica in replicas:
        if replica.deployment not in deployments:
            try:
                deployments[replica.deployment] = store.get_deployment(replica.deployment).deployment
            except NotFound:
                deployments[replica.deployment] = None  # deleted: the next cycle releases its replicas
        deployment = deployments[replica.deployment]
        if deployment is None:
            continue
        if deployment.model not in models:
            try:
                models[deployment.model] = store.get_model(deployment.model)
            except NotFound:
                models[deployment.model] = None
        model = models[deployment.model]
        if model is None:
            continue
        profile = next((p for p in deployment.profiles if p.name == replica.profile), None)
        if profile is None:
            continue
        try:
            resolved = resolve_profile(profile, classes)
        except (InternalError, KeyError):
            continue  # its class changed under it: the gate reports it; keep what runs
        draft: Model | None = None
        if profile.speculative is not None and profile.speculative.draft is not None:
            name = profile.speculative.draft
            if name not in models:
                try:
                    models[name] = store.get_model(name)
                except NotFound:
                    models[name] = None
            found = models[name]
            if found is None:
                continue  # its draft was deleted: placement reports it; keep what runs
            draft = weights_for(found, profile.engine) or found
        adapters: list[Model] = []
        for name in deployment.adapters:
            if name not in adapter_docs:
                try:
                    adapter_docs[name] = store.get_adapter(name).as_model()
                except NotFound:
                    adapter_docs[name] = None  # deleted meanwhile: the replica starts without it
            found_adapter = adapter_docs[name]
            if found_adapter is not None:
                adapters.append(found_adapter)
        out.append(
            Assignment(
                replica=replica,
                profile=profile,
                runtime=resolved.variant,
                driver=resolved.driver,
                # The weights this engine serves (a model's alternate, maybe), never the whole
                # document: the agent fetches exactly these. None loadable (the gate refuses that):
                # the document, which the agent refuses with the reason.
                model=weights_for(model, profile.engine) or model,
                context=profile.context,
                peers=[addresses.get(s.node, "") for s in replica.shards],
                engine_key=keys.get(replica.name),
                task=deployment.task,
                draft=draft,
                adapters=adapters,
            )
        )
    return out


def assignment_set(store: AssignmentReads, node: str, epoch: int) -> AssignmentSet:
    """The node's assignment set for its registration ``epoch`` (blocking: the store's reads)."""
    assigned = store.assignments(node)
    entries = assignment_entries(store, assigned)
    keep = kept(assigned, entries)
    return AssignmentSet(revision=revision_of(entries, keep), epoch=epoch, assignments=entries, keep=keep)


def rendered(answer: AssignmentSet) -> bytes:
    """An assignment set as its JSON answer, serialised by pydantic in one go: the model as
    FastAPI would send it, without validating again what was built from validated documents (a
    node's set is tens of KiB, and thousands of agents re-poll every 20 s)."""
    return answer.model_dump_json(by_alias=True).encode()
