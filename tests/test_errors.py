"""Every exception class of the package hangs off FleetserveError and is drawn in errors.py's tree."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import fleetserve
from fleetserve import errors


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a fleetserve module, by ``module.name``."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(fleetserve.__path__, "fleetserve."):
        if ".migrations" in info.name:
            continue  # alembic scripts, loaded by alembic only
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name:
                found[f"{info.name}.{name}"] = value
    return found


def test_every_exception_class_is_a_fleetserve_error_drawn_in_the_tree():
    classes = exception_classes()
    assert "fleetserve.rawasgi.disconnect.ClientGone" in classes  # the walk sees modules outside errors.py
    assert [k for k, c in classes.items() if not issubclass(c, errors.FleetserveError)] == []
    # The tree's lines by the class each draws: the first word after the tree's own characters.
    tree = {line.strip(" │├└─").split(" ")[0]: line for line in (errors.__doc__ or "").splitlines()}
    drawn = {c: tree.get(c.__name__) for c in classes.values()}
    assert [k for k, c in classes.items() if drawn[c] is None] == []

    # A family defined outside errors.py names its module on its root's line (QueueFull under
    # GatewayRejection, both in fleetserve.gateway.admission).
    def root(c: type[BaseException]) -> type[BaseException]:
        return [b for b in c.__mro__ if b.__module__ == c.__module__][-1]

    elsewhere = [c for c in classes.values() if c.__module__ != errors.__name__]
    assert [c.__name__ for c in elsewhere if f"({c.__module__})" not in (drawn[root(c)] or "")] == []
