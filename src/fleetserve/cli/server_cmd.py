"""``fleetserve server``: the control plane process — admin API, state store, reconciler loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import uvicorn
import yaml
from fastapi import FastAPI
from rich.console import Console
from starlette.concurrency import run_in_threadpool

from fleetserve.autoscale import Signals, load_of
from fleetserve.reconcile.health import HeartbeatPolicy
from fleetserve.server.app import create_app
from fleetserve.server.reconciler import Reconciler, SignalSource
from fleetserve.spec.resources import AutoscalePolicy, Deployment, Replica, ReplicaState
from fleetserve.store.sql import SqlStore, TokenKind

# Engine figures older than this do not count for the autoscaler.
FRESH_SECONDS = 5.0


def ensure_tokens(store: SqlStore, token_file: Path | None, console: Console) -> None:
    """On first start, create the admin and join tokens and show them once (stored hashed)."""
    existing: set[TokenKind] = {t.kind for t in store.list_tokens() if not t.revoked}
    created: dict[str, str] = {}
    now = datetime.now(UTC)
    for kind in (TokenKind.ADMIN, TokenKind.JOIN):
        if kind not in existing:
            created[kind.value] = store.create_token(kind, now).plaintext
    if not created:
        return
    console.print("[bold]fleetserve: new tokens — shown this once, stored only as hashes:[/]")
    for name, plaintext in created.items():
        console.print(f"  {name} token: {plaintext}", markup=False, highlight=False)
    console.print("  use the admin token with `fleetserve login --token ...` or FLEETSERVE_TOKEN;")
    console.print("  agents join with the join token.")
    if token_file is not None:
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.write_text(yaml.safe_dump(created), encoding="utf-8")
        token_file.chmod(0o600)
        console.print(f"  (also written to {token_file}, mode 0600)", markup=False)


def run_server(
    models_dir: Path,
    database_url: str,
    host: str,
    port: int,
    reconcile_interval: float,
    policy: HeartbeatPolicy,
    token_file: Path | None,
    log_level: str,
) -> None:
    """Open (and migrate) the store, then serve the API and run the reconciler until stopped."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    console = Console(soft_wrap=True)
    store = SqlStore.open(database_url)
    try:
        ensure_tokens(store, token_file, console)

        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            # Started and stopped with the app, so a SIGTERM hands the lease over before exit.
            stop = threading.Event()
            reconciler = Reconciler(
                store, policy=policy, signals=autoscale_signals(app), metrics=app.state.metrics
            )
            loop = threading.Thread(
                target=reconciler.run_forever, args=(stop, reconcile_interval), name="reconciler", daemon=True
            )
            loop.start()
            try:
                yield
            finally:
                stop.set()
                await run_in_threadpool(loop.join, reconcile_interval + 10)

        app = create_app(store, lifespan=lifespan, models_dir=models_dir)
        # Long-polling agents hold requests open; do not let them delay a shutdown for long.
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=3,
        )
        console.print(f"fleetserve server: http://{host}:{port} (OpenAPI at /docs), state in {database_url}")
        uvicorn.Server(config).run()
    finally:
        store.close()


def autoscale_signals(app: FastAPI) -> SignalSource:
    """What the autoscaler sees, from this server's observer (engine metrics) and gateway."""
    observer = app.state.observer
    gateway = app.state.gateway

    def signals(dep: Deployment, replicas: list[Replica], now: float) -> Signals:
        policy = dep.autoscale or AutoscalePolicy()
        ready = [r for r in replicas if r.state is ReplicaState.RUNNING]
        fresh = []
        for replica in ready:
            load = observer.loads.get(replica.name)
            if load is not None and now - load.at <= FRESH_SECONDS:
                fresh.append(load_of(policy.metric, load.running, load.waiting))
        held = gateway.admission.depth(dep.name).waiting if gateway is not None else 0
        last = gateway.last_request.get(dep.name) if gateway is not None else None
        return Signals(dep.name, len(ready), len(replicas), tuple(fresh), held, last)

    return signals


def heartbeat_policy(not_ready_after: float, lost_after: float) -> HeartbeatPolicy:
    """The liveness deadlines from command-line seconds."""
    return HeartbeatPolicy(timedelta(seconds=not_ready_after), timedelta(seconds=lost_after))
