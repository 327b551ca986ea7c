"""The deployments aggregate over SQL: model documents, deployments (spec, generation, status)
and the placement decisions recorded for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from fleetserve.errors import (
    NotFound,
)
from fleetserve.spec.resources import (
    Deployment,
    Model,
)
from fleetserve.spec.status import DecisionRecord, DeploymentStatus
from fleetserve.store.base import SqlBase, doc
from fleetserve.store.tables import (
    DecisionRow,
    DeploymentRow,
    ModelRow,
    stamp,
)


@dataclass(frozen=True)
class StoredDeployment:
    """A deployment as stored: its spec, the generation of that spec, and its status."""

    deployment: Deployment
    generation: int
    status: DeploymentStatus
    # The spec before the last change (what ``rollout undo`` applies again); None before any.
    previous: Deployment | None = None


@dataclass(frozen=True)
class Decision:
    """One recorded placement decision or explanation for a deployment."""

    id: int
    deployment: str
    created_at: datetime
    explanation: DecisionRecord


def _stored_deployment(row: DeploymentRow) -> StoredDeployment:
    previous = Deployment.model_validate(row.previous_spec) if row.previous_spec else None
    return StoredDeployment(
        Deployment.model_validate(row.spec),
        row.generation,
        DeploymentStatus.model_validate(row.status or {}),
        previous,
    )


class SqlDeployments(SqlBase):
    """Models, deployments and decisions, over SQL."""

    def put_model(self, model: Model) -> None:
        with self._write(f"storing model {model.name}") as s:
            self._put_model(s, model)

    def _put_model(self, s: Session, model: Model) -> str:
        """Create or replace a model, keeping the spec it replaces (``undo_model``); created,
        configured or unchanged."""
        spec = doc(model)
        if self._insert_new(s, ModelRow, name=model.name, spec=spec):
            return "created"
        row = s.scalars(select(ModelRow).where(ModelRow.name == model.name).with_for_update()).one()
        if row.spec == spec:
            return "unchanged"
        row.previous_spec, row.spec = row.spec, spec
        return "configured"

    def undo_model(self, name: str) -> Model:
        """Apply a model's previous spec again (the current one becomes the previous, so a second
        undo redoes): new weights roll the deployments serving it back; raises NotFound for a
        model with no previous spec."""
        with self._write(f"undoing the last change of model {name}") as s:
            row = s.scalars(select(ModelRow).where(ModelRow.name == name).with_for_update()).one_or_none()
            if row is None:
                raise NotFound(f"no model named {name!r} is stored")
            if not row.previous_spec:
                raise NotFound(f"model {name!r} has no previous spec to go back to")
            row.spec, row.previous_spec = row.previous_spec, row.spec
            return Model.model_validate(row.spec)

    def get_model(self, name: str) -> Model:
        with self._read(f"reading model {name}") as s:
            row = s.get(ModelRow, name)
            if row is None:
                raise NotFound(f"no model named {name!r} is stored")
            return Model.model_validate(row.spec)

    def list_models(self) -> list[Model]:
        with self._read("listing models") as s:
            out = [Model.model_validate(r.spec) for r in s.scalars(select(ModelRow))]
        return sorted(out, key=lambda m: m.name)

    def delete_model(self, name: str) -> None:
        with self._write(f"deleting model {name}") as s:
            self._delete(s, ModelRow, name, "model")

    def put_deployment(self, deployment: Deployment) -> int:
        """Create or replace a deployment; its generation: 1 when new, +1 when the spec changed,
        unchanged when the same spec is applied again."""
        with self._write(f"storing deployment {deployment.name}") as s:
            return self._put_deployment(s, deployment)[0]

    def _put_deployment(self, s: Session, deployment: Deployment) -> tuple[int, str]:
        spec = doc(deployment)
        if self._insert_new(s, DeploymentRow, name=deployment.name, spec=spec, generation=1, status={}):
            return 1, "created"
        row = s.scalars(
            select(DeploymentRow).where(DeploymentRow.name == deployment.name).with_for_update()
        ).one()
        if row.spec == spec:
            return row.generation, "unchanged"
        row.previous_spec = row.spec
        row.spec = spec
        row.generation += 1
        return row.generation, "configured"

    def undo_deployment(self, name: str) -> StoredDeployment:
        """Apply a deployment's previous spec again (the current one becomes the previous, so a
        second undo redoes); raises NotFound for a deployment with no previous spec."""
        with self._write(f"undoing the last change of deployment {name}") as s:
            row = s.scalars(
                select(DeploymentRow).where(DeploymentRow.name == name).with_for_update()
            ).one_or_none()
            if row is None:
                raise NotFound(f"no deployment named {name!r} is stored")
            if not row.previous_spec:
                raise NotFound(f"deployment {name!r} has no previous revision to go back to")
            row.spec, row.previous_spec = row.previous_spec, row.spec
            row.generation += 1
            s.flush()
            return _stored_deployment(row)

    def get_deployment(self, name: str) -> StoredDeployment:
        with self._read(f"reading deployment {name}") as s:
            row = s.get(DeploymentRow, name)
            if row is None:
                raise NotFound(f"no deployment named {name!r} is stored")
            return _stored_deployment(row)

    def list_deployments(self) -> list[StoredDeployment]:
        with self._read("listing deployments") as s:
            out = [_stored_deployment(r) for r in s.scalars(select(DeploymentRow))]
        return sorted(out, key=lambda d: d.deployment.name)

    def set_deployment_status(self, name: str, status: DeploymentStatus) -> None:
        """Replace a deployment's status (kept as ``status.stored()``); raises NotFound."""
        with self._write(f"setting the status of deployment {name}") as s:
            result = s.connection().execute(
                update(DeploymentRow).where(DeploymentRow.name == name).values(status=status.stored())
            )
            if result.rowcount == 0:
                raise NotFound(f"no deployment named {name!r} is stored")

    def delete_deployment(self, name: str) -> None:
        """Forget a deployment. Its replicas stay allocated until released (stopping them is the
        reconciler's job, not the store's)."""
        with self._write(f"deleting deployment {name}") as s:
            self._delete(s, DeploymentRow, name, "deployment")

    def record_decision(self, deployment: str, explanation: DecisionRecord, now: datetime) -> int:
        """Keep a placement decision (as ``explanation.stored()``); its id."""
        when = stamp(now)
        with self._write(f"recording a decision for {deployment}") as s:
            row = DecisionRow(deployment=deployment, created_at=when, explanation=explanation.stored())
            s.add(row)
            s.flush()
            return row.id

    def list_decisions(self, deployment: str | None = None, limit: int = 100) -> list[Decision]:
        """The most recent decisions (of one deployment, if named), newest first."""
        query = (
            select(DecisionRow).order_by(DecisionRow.created_at.desc(), DecisionRow.id.desc()).limit(limit)
        )
        if deployment is not None:
            query = query.where(DecisionRow.deployment == deployment)
        with self._read("listing decisions") as s:
            return [
                Decision(r.id, r.deployment, r.created_at, DecisionRecord.model_validate(r.explanation))
                for r in s.scalars(query)
            ]

    def prune_decisions(self, before: datetime) -> int:
        """Forget decisions recorded before ``before``; how many."""
        when = stamp(before)
        with self._write("pruning decisions") as s:
            return s.connection().execute(delete(DecisionRow).where(DecisionRow.created_at < when)).rowcount
