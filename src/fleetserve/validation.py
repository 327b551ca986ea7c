"""Cross-document rules: engine capabilities against device classes, and the multi-accelerator gate.

Two kinds of outcome, kept apart on purpose:

- a *refusal* (``validate_deployment``) is a structural mistake in the deployment itself — vLLM
  without a device class, llama.cpp asked to split, a runtime that computes on another driver
  than its class, an engine that loads none of the model's formats (``weights_problems``). It is
  an error at apply time, before anything starts.
- the *gate* (``gate``) sets ``Accepted=False, reason UnsupportedDevices`` when a profile's class
  claims a driver that no engine variant or no node serves. It never stops or deletes what runs:
  it only keeps new replicas off the profiles it names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fleetserve.conditions import Condition, ConditionReason, ConditionType
from fleetserve.drivers import DRIVERS, Driver, RuntimeVariant, host_driver, parse_driver
from fleetserve.engines.registry import ENGINES, formats_text, weights_for
from fleetserve.engines.spec import EngineKind, Task
from fleetserve.errors import InternalError, Problem
from fleetserve.spec.adapter import Adapter
from fleetserve.spec.resources import CpuRequest, Deployment, DeviceClass, Model, Profile

# CPU cores a CPU profile claims when it does not say.
DEFAULT_CPU_CORES = 4


@dataclass(frozen=True)
class ResolvedProfile:
    """A profile with its engine variant and driver worked out; what placement consumes."""

    name: str
    engine: EngineKind
    variant: RuntimeVariant
    driver: Driver
    device_class: str | None
    devices_per_node: int
    nodes: int
    cpu: CpuRequest | None  # always set for CPU profiles; GPU profiles claim CPU only if asked
    context: int | None
    # The draft model a speculative profile runs beside its model (placed with the replica).
    draft: str | None = None

    @property
    def on_cpu(self) -> bool:
        return self.device_class is None

    def host_request(self) -> CpuRequest:
        """The CPU request of a profile that runs on the host (always set once resolved)."""
        if self.cpu is None:
            raise InternalError(f"profile {self.name}: a resolved CPU profile has no CPU request")
        return self.cpu


# A negative number is a flag's value ("--n-predict -1"), not a flag.
_NUMBER = re.compile(r"-\d+(\.\d+)?")


def _needs_accelerator(driver: Driver | None) -> bool:
    """Whether a runtime variant computing on ``driver`` needs a device (a class) to run."""
    return driver is not None and DRIVERS[driver].is_accelerator


def _variants_text(engine: EngineKind) -> str:
    return ", ".join(f"{v.value} ({d.value})" for v, d in ENGINES[engine].variants.items())


def profile_problems(profile: Profile, classes: Mapping[str, DeviceClass], location: str) -> list[Problem]:
    """Every refusal for one profile, each saying why and what would be valid."""
    caps = ENGINES[profile.engine]
    field = f"profiles.{profile.name}"
    out: list[Problem] = []
    if profile.runtime is not None and profile.runtime not in caps.variants:
        out.append(
            Problem(
                location,
                f"{field}.runtime",
                f"engine {profile.engine.value} has no runtime {profile.runtime.value!r}; "
                f"valid: {_variants_text(profile.engine)}",
            )
        )
    if not caps.tensor_parallel and profile.devices_per_node > 1:
        out.append(
            Problem(
                location,
                f"{field}.devicesPerNode",
                f"engine {profile.engine.value} refuses tensor parallel "
                f"(devicesPerNode={profile.devices_per_node}): {caps.why_no_split}",
            )
        )
    if not caps.multi_node and profile.nodes > 1:
        out.append(
            Problem(
                location,
                f"{field}.nodes",
                f"engine {profile.engine.value} refuses multi-node "
                f"(nodes={profile.nodes}): {caps.why_no_split}",
            )
        )
    for arg in profile.engine_args:
        flag = arg.split("=", 1)[0]
        task_flag = any(flag in t.flags() for t in caps.tasks.values())
        if (
            flag.startswith("-")
            and not _NUMBER.fullmatch(flag)
            and flag not in caps.allowed_args
            and not task_flag
        ):
            out.append(
                Problem(
                    location,
                    f"{field}.engineArgs",
                    f"{flag} is not an allowed {profile.engine.value} argument (host, port, model and "
                    f"served name are fleetserve's); allowed: {', '.join(sorted(caps.allowed_args))}",
                )
            )
    if profile.device_class is None:
        # An engine that does not default to the CPU runs there only when its runtime says so.
        named_cpu = profile.runtime is not None and caps.variants.get(profile.runtime) == host_driver()
        if not caps.cpu_without_class and not named_cpu:
            out.append(Problem(location, f"{field}.deviceClass", caps.why_no_cpu))
        elif profile.runtime is not None and _needs_accelerator(caps.variants.get(profile.runtime)):
            out.append(
                Problem(
                    location,
                    f"{field}.runtime",
                    f"runtime {profile.runtime.value} computes on "
                    f"{caps.variants[profile.runtime].value}, but a profile without a "
                    "deviceClass runs on the CPU; name a deviceClass or use runtime cpu",
                )
            )
        # One node's CPU: the splits an engine does across GPUs do not apply (the engine's own
        # refusal, when it has one, already said so).
        if caps.tensor_parallel and profile.devices_per_node > 1:
            out.append(
                Problem(
                    location,
                    f"{field}.devicesPerNode",
                    f"a profile without a deviceClass runs on one node's CPU: {profile.engine.value} "
                    f"refuses tensor parallel there (devicesPerNode={profile.devices_per_node}); "
                    "use devicesPerNode: 1, or name a GPU deviceClass",
                )
            )
        if caps.multi_node and profile.nodes > 1:
            out.append(
                Problem(
                    location,
                    f"{field}.nodes",
                    f"a profile without a deviceClass runs on one node's CPU: {profile.engine.value} "
                    f"refuses multi-node there (nodes={profile.nodes}); use nodes: 1, or name a GPU "
                    "deviceClass",
                )
            )
        return out
    cls = classes.get(profile.device_class)
    if cls is None:
        known = ", ".join(sorted(classes)) or "none defined"
        out.append(
            Problem(
                location,
                f"{field}.deviceClass",
                f"unknown device class {profile.device_class!r}; known classes: {known}",
            )
        )
        return out
    driver = parse_driver(cls.driver)
    if driver is None or driver not in caps.drivers():
        return out  # the gate reports it as UnsupportedDevices, not a refusal
    if profile.runtime is None and driver not in caps.default_variant:
        fits = [v.value for v, d in caps.variants.items() if d == driver]
        out.append(
            Problem(
                location,
                f"{field}.runtime",
                f"engine {profile.engine.value} runs on class {cls.name} ({driver.value}) only when "
                f"asked: say runtime: {' or '.join(fits)}",
            )
        )
    if profile.runtime is not None and profile.runtime in caps.variants:
        runtime_driver = caps.variants[profile.runtime]
        if runtime_driver != driver:
            fits = [v.value for v, d in caps.variants.items() if d == driver]
            out.append(
                Problem(
                    location,
                    f"{field}.runtime",
                    f"runtime {profile.runtime.value} computes on {runtime_driver.value}, "
                    f"but class {cls.name} is driven by {driver.value}; "
                    f"use runtime {' or '.join(fits)}",
                )
            )
    return out


def profile_variant(profile: Profile, classes: Mapping[str, DeviceClass]) -> RuntimeVariant | None:
    """The runtime variant a profile runs: its own, else its class's driver's default, else the
    CPU's; None where that cannot be told (an unknown class or driver: refused or gated elsewhere)."""
    caps = ENGINES[profile.engine]
    if profile.runtime is not None:
        return profile.runtime
    if profile.device_class is None:
        return caps.default_variant.get(host_driver(), RuntimeVariant.CPU)
    cls = classes.get(profile.device_class)
    driver = parse_driver(cls.driver) if cls is not None else None
    return caps.default_variant.get(driver) if driver is not None else None


def task_problems(
    task: Task, profile: Profile, classes: Mapping[str, DeviceClass], location: str
) -> list[Problem]:
    """Refusals of a profile for the deployment's ``task``: its engine (or the variant it runs)
    does not start that task, or its engineArgs set a flag the task sets (``EngineSpec.tasks``)."""
    caps = ENGINES[profile.engine]
    field = f"profiles.{profile.name}"
    out: list[Problem] = []
    start = caps.tasks.get(task)
    variant = profile_variant(profile, classes)
    if start is None:
        serving = [e.value for e, s in ENGINES.items() if task in s.tasks]
        out.append(
            Problem(
                location,
                "task",
                f"engine {profile.engine.value} ({field}) does not serve task {task.value}; "
                f"use engine {' or '.join(serving) or 'none'}, or task generate",
            )
        )
    elif variant is not None and not start.serves(variant):
        out.append(
            Problem(
                location,
                "task",
                f"{profile.engine.value}'s {variant.value} variant ({field}) does not serve task "
                f"{task.value}: {start.why_not}",
            )
        )
    for arg in profile.engine_args:
        flag = arg.split("=", 1)[0]
        meant = [t.value for t, s in caps.tasks.items() if flag in s.flags()]
        if meant:
            out.append(
                Problem(
                    location,
                    f"{field}.engineArgs",
                    f"{flag} is set by the deployment's task: say task: {' or '.join(meant)} "
                    "and leave it out of engineArgs",
                )
            )
    return out


def validate_deployment(
    dep: Deployment, classes: Mapping[str, DeviceClass], location: str = ""
) -> list[Problem]:
    """Every refusal in a deployment; empty when it may be applied."""
    where = location or f"Deployment {dep.name}"
    out: list[Problem] = []
    for profile in dep.profiles:
        out.extend(profile_problems(profile, classes, where))
        out.extend(task_problems(dep.task, profile, classes, where))
    return out


def draft_problems(dep: Deployment, models: Mapping[str, Model], location: str = "") -> list[Problem]:
    """A profile's draft model (``speculative.draft``) that is not a Model, or whose weights its
    engine cannot load: the draft is fetched and served like the deployment's model."""
    where = location or f"Deployment {dep.name}"
    out: list[Problem] = []
    for profile in dep.profiles:
        name = profile.speculative.draft if profile.speculative is not None else None
        if name is None:
            continue
        field = f"profiles.{profile.name}.speculative.draft"
        draft = models.get(name)
        if draft is None:
            known = ", ".join(sorted(models)) or "none defined"
            out.append(
                Problem(where, field, f"unknown draft model {name!r}: apply it as a Model; known: {known}")
            )
        elif weights_for(draft, profile.engine) is None:
            out.append(
                Problem(
                    where,
                    field,
                    f"engine {profile.engine.value} loads {formats_text(profile.engine)} weights, and draft "
                    f"model {name} has {' and '.join(w.format.value for w in draft.weights())} only: add "
                    f"an alternate of format {formats_text(profile.engine)} to model {name}",
                )
            )
    return out


def adapter_problems(dep: Deployment, adapters: Mapping[str, Adapter], location: str = "") -> list[Problem]:
    """A deployment's ``adapters`` that are not Adapters, are on another model than the
    deployment's, or that a profile's engine cannot load (its row's ``adapters``: none, or another
    format); adapters on a deployment of a task other than generate."""
    where = location or f"Deployment {dep.name}"
    out: list[Problem] = []
    if dep.adapters and dep.task is not Task.GENERATE:
        out.append(
            Problem(
                where,
                "adapters",
                f"LoRA adapters serve generated text, and this deployment's task is {dep.task.value}: "
                "drop adapters, or list them on a deployment of task generate",
            )
        )
    for i, name in enumerate(dep.adapters):
        field = f"adapters[{i}]"
        adapter = adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(adapters)) or "none defined"
            out.append(
                Problem(where, field, f"unknown adapter {name!r}: apply it as an Adapter; known: {known}")
            )
            continue
        if adapter.base != dep.model:
            out.append(
                Problem(
                    where,
                    field,
                    f"adapter {name} is on model {adapter.base}, and this deployment serves model "
                    f"{dep.model}: list it on a deployment of model {adapter.base}, or drop it here",
                )
            )
        for profile in dep.profiles:
            support = ENGINES[profile.engine].adapters
            if support is None:
                out.append(
                    Problem(
                        where,
                        field,
                        f"profile {profile.name}: engine {profile.engine.value} loads no LoRA adapters: "
                        "drop adapters, or serve them with another engine",
                    )
                )
            elif support.format is not adapter.format:
                others = [
                    e.kind.value
                    for e in ENGINES.values()
                    if e.adapters and e.adapters.format is adapter.format
                ]
                out.append(
                    Problem(
                        where,
                        field,
                        f"profile {profile.name}: engine {profile.engine.value} loads "
                        f"{support.format.value} adapters, and adapter {name} is {adapter.format.value}: "
                        f"apply the adapter in format {support.format.value} under another name, or "
                        f"serve it from a profile of engine {' or '.join(others) or 'none'}",
                    )
                )
    return out


def weights_problems(dep: Deployment, model: Model, location: str = "") -> list[Problem]:
    """A profile whose engine loads none of its model's formats (primary or alternates), refused
    with the fix: the alternate to add (``engines.registry.weights_for`` is the rule)."""
    where = location or f"Deployment {dep.name}"
    has = " and ".join(w.format.value for w in model.weights())
    return [
        Problem(
            where,
            f"profiles.{profile.name}.engine",
            f"engine {profile.engine.value} loads {formats_text(profile.engine)} weights, and model "
            f"{model.name} has {has} only: add an alternate of format {formats_text(profile.engine)} "
            f"to model {model.name} (alternates: [{{format, source}}]), or use another engine",
        )
        for profile in dep.profiles
        if weights_for(model, profile.engine) is None
    ]


def unsupported_driver(
    profile: Profile, classes: Mapping[str, DeviceClass], served: frozenset[Driver]
) -> str | None:
    """The driver name that makes this profile unsupported, or None when it is supported."""
    caps = ENGINES[profile.engine]
    if profile.device_class is None:
        host = host_driver()
        return None if host in served else host.value
    cls = classes.get(profile.device_class)
    if cls is None:
        return None
    driver = parse_driver(cls.driver)
    if driver is None or driver not in caps.drivers() or driver not in served:
        return cls.driver
    return None


def resolve_profile(profile: Profile, classes: Mapping[str, DeviceClass]) -> ResolvedProfile:
    """Work out variant and driver for a profile that passed ``validate_deployment`` and the gate."""
    caps = ENGINES[profile.engine]
    if profile.device_class is None:
        driver = host_driver()
    else:
        parsed = parse_driver(classes[profile.device_class].driver)
        if parsed is None:
            raise InternalError(f"profile {profile.name}: resolve_profile needs a gated profile")
        driver = parsed
    variant = profile.runtime or caps.default_variant[driver]
    cpu = profile.cpu
    if cpu is None and not DRIVERS[driver].is_accelerator:
        cpu = CpuRequest(cores=DEFAULT_CPU_CORES)
    return ResolvedProfile(
        name=profile.name,
        engine=profile.engine,
        variant=variant,
        driver=driver,
        device_class=profile.device_class,
        devices_per_node=profile.devices_per_node,
        nodes=profile.nodes,
        cpu=cpu,
        context=profile.context,
        draft=profile.speculative.draft if profile.speculative is not None else None,
    )


@dataclass(frozen=True)
class GateResult:
    """The gate's verdict: the Accepted condition and the profiles placement may use."""

    accepted: Condition
    usable: tuple[ResolvedProfile, ...]
    unsupported: Mapping[str, str]  # profile name → driver it claims


def gate(dep: Deployment, classes: Mapping[str, DeviceClass], served: Iterable[Driver]) -> GateResult:
    """Set Accepted / UnsupportedDevices for a deployment; never touches what already runs.

    ``served`` is the list of drivers some node (or cluster stack) serves; absent means empty.
    """
    served_set = frozenset(served)
    problems = validate_deployment(dep, classes)
    if problems:
        return GateResult(
            Condition(
                ConditionType.ACCEPTED,
                False,
                ConditionReason.INVALID_PROFILE,
                "; ".join(str(p) for p in problems),
            ),
            (),
            {},
        )
    unsupported: dict[str, str] = {}
    usable: list[ResolvedProfile] = []
    for profile in dep.profiles_by_priority():
        bad = unsupported_driver(profile, classes, served_set)
        if bad is None:
            usable.append(resolve_profile(profile, classes))
        else:
            unsupported[profile.name] = bad
    if unsupported:
        parts = [f"profile {p} claims driver {d}" for p, d in unsupported.items()]
        msg = "; ".join(parts) + " which no engine variant or node serves; replicas already running are kept"
        accepted = Condition(ConditionType.ACCEPTED, False, ConditionReason.UNSUPPORTED_DEVICES, msg)
        return GateResult(accepted, tuple(usable), unsupported)
    accepted = Condition(ConditionType.ACCEPTED, True, ConditionReason.ACCEPTED, "every profile is servable")
    return GateResult(accepted, tuple(usable), {})
