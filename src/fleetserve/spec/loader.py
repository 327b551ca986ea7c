"""Load multi-document, kubectl-like YAML (``kind:`` per document) into resource objects.

Every problem found is reported at once, each naming the file, the document (1-based, with its
kind and name where known), the field path, and what would be valid.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from fleetserve.errors import ConfigError, Problem
from fleetserve.spec.adapter import Adapter
from fleetserve.spec.cluster import Cluster
from fleetserve.spec.endpoint import Endpoint
from fleetserve.spec.resources import Deployment, DeviceClass, Fabric, Model, Node, Replica
from fleetserve.spec.yamlbounds import safe_load_all

KINDS: Mapping[str, type[BaseModel]] = {
    "DeviceClass": DeviceClass,
    "Fabric": Fabric,
    "Node": Node,
    "Model": Model,
    "Deployment": Deployment,
    "Replica": Replica,
    "Cluster": Cluster,
    "Endpoint": Endpoint,
    "Adapter": Adapter,
}


@dataclass
class Documents:
    """The resources of one or more files, by kind, in the order they were written."""

    classes: list[DeviceClass] = field(default_factory=list)
    fabrics: list[Fabric] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    models: list[Model] = field(default_factory=list)
    deployments: list[Deployment] = field(default_factory=list)
    replicas: list[Replica] = field(default_factory=list)
    clusters: list[Cluster] = field(default_factory=list)
    endpoints: list[Endpoint] = field(default_factory=list)
    adapters: list[Adapter] = field(default_factory=list)

    def add(self, resource: BaseModel) -> None:
        """Append one parsed resource to the list of its kind."""
        buckets: dict[type[BaseModel], list[Any]] = {
            DeviceClass: self.classes,
            Fabric: self.fabrics,
            Node: self.nodes,
            Model: self.models,
            Deployment: self.deployments,
            Replica: self.replicas,
            Cluster: self.clusters,
            Endpoint: self.endpoints,
            Adapter: self.adapters,
        }
        buckets[type(resource)].append(resource)

    def merge(self, other: Documents) -> Documents:
        """A new Documents holding this one's resources followed by ``other``'s."""
        return Documents(
            classes=self.classes + other.classes,
            fabrics=self.fabrics + other.fabrics,
            nodes=self.nodes + other.nodes,
            models=self.models + other.models,
            deployments=self.deployments + other.deployments,
            replicas=self.replicas + other.replicas,
            clusters=self.clusters + other.clusters,
            endpoints=self.endpoints + other.endpoints,
            adapters=self.adapters + other.adapters,
        )

    def all(self) -> Iterable[BaseModel]:
        """Every resource, kind by kind."""
        yield from self.classes
        yield from self.fabrics
        yield from self.nodes
        yield from self.models
        yield from self.deployments
        yield from self.replicas
        yield from self.clusters
        yield from self.endpoints
        yield from self.adapters


def _loc_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # pydantic puts union-member and validator names into loc; they are no field.
            if part in {"int", "ReplicaRange", "function-before[<lambda>(), int]"} or "[" in part:
                continue
            out += ("." if out else "") + part
    return out


def _field_names(model: type[BaseModel]) -> list[str]:
    return sorted(f.alias or name for name, f in model.model_fields.items())


def _message(err: Mapping[str, Any], model: type[BaseModel]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unknown field; valid fields of {model.__name__} are: {', '.join(_field_names(model))}"
    if kind == "missing":
        return "field required"
    if kind == "enum":
        expected = err.get("ctx", {}).get("expected", "")
        return f"got {err.get('input')!r}; valid values: {expected}"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


_NAMED_FIELD = re.compile(
    r"^([A-Za-z][A-Za-z0-9]*(?:\[\d+\])?(?:\.[A-Za-z][A-Za-z0-9]*(?:\[\d+\])?)*): (.+)$", re.S
)
_UNION_NOISE = {"int_type", "int_parsing", "model_type", "dict_type"}


def problems_from_pydantic(
    exc: PydanticValidationError, model: type[BaseModel], location: str
) -> list[Problem]:
    """Turn pydantic's errors into Problems that name the field and what would be valid."""
    errors = [(_loc_path(tuple(e["loc"])), e) for e in exc.errors()]
    fields = [f for f, _ in errors]
    out: list[Problem] = []
    for path, err in errors:
        # A union (replicas: int | {min, max}) reports a type error per member it tried; keep
        # the one that says what is wrong. A too-short list next to a deeper error is noise.
        if err["type"] in _UNION_NOISE and fields.count(path) > 1:
            continue
        if err["type"] == "too_short" and any(f.startswith(path + "[") for f in fields):
            continue
        message = _message(err, model)
        # A check across fields (a model validator) names the field it is about as "FIELD: ...".
        named = _NAMED_FIELD.match(message) if not path else None
        if named is not None:
            path, message = named.group(1), named.group(2)
        out.append(Problem(location=location, field=path, message=message))
    return out or [Problem(location, "", str(exc))]


def parse_document(raw: Any, location: str) -> BaseModel:
    """Parse one YAML/JSON document by its ``kind``; raise ConfigError naming what is wrong."""
    if not isinstance(raw, dict):
        raise ConfigError([Problem(location, "", "a document must be a mapping with a 'kind' field")])
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ConfigError([Problem(location, "kind", f"got {kind!r}; valid kinds: {', '.join(KINDS)}")])
    model = KINDS[kind]
    name = raw.get("name")
    where = f"{location} ({kind} {name})" if isinstance(name, str) else f"{location} ({kind})"
    try:
        return model.model_validate(raw)
    except PydanticValidationError as exc:
        raise ConfigError(problems_from_pydantic(exc, model, where)) from exc


def load_text(text: str, filename: str = "<string>") -> Documents:
    """Parse every document in ``text``; collect every problem before raising."""
    docs = Documents()
    problems: list[Problem] = []
    try:
        raws = safe_load_all(text)
    except yaml.YAMLError as exc:
        # Point at where the broken construct starts (context), else where parsing stopped.
        mark = getattr(exc, "context_mark", None) or getattr(exc, "problem_mark", None)
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else filename
        what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        raise ConfigError([Problem(where, "", f"not valid YAML: {what or exc}")]) from exc
    for i, raw in enumerate(raws, start=1):
        if raw is None:
            continue
        try:
            docs.add(parse_document(raw, f"{filename} document {i}"))
        except ConfigError as err:
            problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return docs


def load_files(paths: Iterable[Path]) -> Documents:
    """Load and merge several YAML files; a missing or unreadable file is a ConfigError."""
    merged = Documents()
    problems: list[Problem] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            problems.append(Problem(str(path), "", f"cannot read file: {exc.strerror or exc}"))
            continue
        try:
            merged = merged.merge(load_text(text, str(path)))
        except ConfigError as err:
            problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return merged
