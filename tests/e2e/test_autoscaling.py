"""The autoscaler end to end: a real ``fleetserve server`` (reconcile every 0.2 s) and one real
``fleetserve agent`` (node ``as-a``, this machine's 2 cores) running ``llama-server`` replicas of
the tiny model; load comes through the gateway's /v1, decisions are read from the deployment's
``status.autoscaler`` (the API while polling, ``fleetserve describe deployment NAME -o json`` to
confirm what an operator sees).

(Named test_autoscaling.py: tests/test_autoscale.py, the autoscaler's pure core, already holds the
module name ``test_autoscale``, and two test modules of one basename do not collect together.)

- ``elastic``: ``replicas: {min: 1, max: 2}``, ``autoscale: {target: 2, scaleDownCooldownSeconds:
  5}``. Four concurrent slow requests (4 = a replica's llama.cpp slots, so the gateway queues none)
  make a load of 4 at a target of 2 per replica: 2 replicas, exactly ``replicas.max``, so the
  reason is LoadAboveTarget. (With target 1 any load above 2 needs more than max, and the
  clamp that bites is the reason: AboveMax.) When the load stops the count goes back to 1 after
  the cooldown (LoadBelowTargetAfterCooldown).
- ``scratch``: ``replicas: {min: 0, max: 1}``, ``autoscale: {scaleToZeroAfterSeconds: 3,
  scaleDownCooldownSeconds: 3}``. A min-0 deployment starts at zero; a request is held while a
  replica starts (HeldRequest) and answered; idle, it goes back to zero (Idle); the next request
  is held again while a replica starts.

Every process (server, agent, llama-servers) is stopped at teardown; an engine left behind fails
the module.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import (
    AgentFactory,
    AgentProcess,
    ServerFactory,
    ServerProcess,
    cli_env,
    engine_ready,
    replica_details,
    run_cli,
    short_deadline_args,
    slow_chat,
    tiny_documents,
    wait_for,
)
from openai import OpenAI

pytestmark = pytest.mark.slow

NODE = "as-a"
# A GBNF grammar with 2000 alternatives alive at every step: ~10 ms a token, ~40 ms with the 4
# slots busy (as in test_gateway.py); ignore_eos makes every answer run to max_tokens.
ROUTE_REFRESH = 1.5  # the gateway re-reads its routes every second


@dataclass
class Fleet:
    server: ServerProcess
    agent: AgentProcess
    key: str
    tmp: Path

    def http(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.server.url}/v1",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=timeout,
        )

    def openai(self) -> OpenAI:
        return OpenAI(base_url=f"{self.server.url}/v1", api_key=self.key, max_retries=0, timeout=60)

    def deployment(self, name: str) -> dict[str, Any]:
        with self.server.client(timeout=10) as api:
            response = api.get(f"/deployments/{name}")
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def decisions(self, name: str) -> list[dict[str, Any]]:
        """The autoscaler's decision log of ``name`` (oldest first), as its status shows it."""
        return list(self.deployment(name)["status"].get("autoscaler") or [])

    def replicas(self, name: str) -> list[dict[str, Any]]:
        return replica_details(self.server, name)

    def serving(self, name: str) -> dict[str, int]:
        """{replica: port} of the Running replicas of ``name`` whose engine answers /health."""
        ports = {
            r["name"]: int(r["status"]["port"])
            for r in self.replicas(name)
            if r["state"] == "Running" and r["status"].get("port")
        }
        return {n: p for n, p in ports.items() if engine_ready(p)}

    def engine_ports(self) -> set[int]:
        """The ports of the llama-servers the agent runs now (from their argv)."""
        out = set()
        for proc in self.agent.engines():
            try:
                argv = proc.cmdline()
            except Exception:  # exited meanwhile
                continue
            if "--port" in argv:
                out.add(int(argv[argv.index("--port") + 1]))
        return out

    def describe(self, name: str) -> dict[str, Any]:
        """``fleetserve describe deployment NAME -o json``, as an operator runs it."""
        out = run_cli(
            "describe", "deployment", name, "-o", "json", env=cli_env(self.server, self.tmp / "cli")
        )
        assert out.returncode == 0, out.stderr
        result: dict[str, Any] = json.loads(out.stdout)
        return result


def find(
    decisions: list[dict[str, Any]], reason: str, previous: int, desired: int, after: float = 0.0
) -> dict[str, Any] | None:
    """The first decision moving ``previous`` → ``desired`` for ``reason``, at or after ``after``."""
    return next(
        (
            d
            for d in decisions
            if d["reason"] == reason
            and d["previous"] == previous
            and d["desired"] == desired
            and d["changed"]
            and d["at"] >= after
        ),
        None,
    )


def render_log(decisions: list[dict[str, Any]], t0: float) -> str:
    """The decision log, one line per entry, times relative to ``t0`` (server and test share
    CLOCK_MONOTONIC: ``at`` is the server's time.monotonic())."""
    lines = []
    for d in decisions:
        first, last = d["at"] - t0, d.get("last_at", d["at"]) - t0
        span = f"{first:+7.2f}s" if d.get("repeats", 1) == 1 else f"{first:+7.2f}s..{last:+.2f}s"
        lines.append(
            f"  {span:<20} {d['previous']}->{d['desired']} {d['reason']:<28} x{d.get('repeats', 1):<3} "
            f"load {d['load']:g} ready {d['ready']} reported {d['reported']}: {d['detail']}"
        )
    return "\n".join(lines)


def elastic_documents(name: str) -> list[dict[str, Any]]:
    [_, doc] = tiny_documents(Path("unused"), name)
    doc["model"] = "tiny"
    return [doc]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("autoscale")
    servers = ServerFactory(tmp)
    agents = AgentFactory(tmp)
    orphans: list[str] = []
    try:
        server = servers.start(
            f"sqlite:///{tmp / 'state.db'}",
            name="server",
            reconcile_interval=0.2,
            extra_args=short_deadline_args(tmp),
        )
        agent = agents.start(server.url, server.join_token, NODE)
        with server.client(timeout=10) as api:
            wait_for(
                lambda: any(n["name"] == NODE and n["state"] == "Ready" for n in api.get("/nodes").json()),
                timeout=60,
                what=f"{NODE} to register",
            )
            model = tmp / "tiny.gguf"
            out = run_cli("dev", "tiny-model", str(model))
            assert out.returncode == 0 and model.exists(), out.stderr
            [model_doc, _] = tiny_documents(model)
            server.apply([model_doc], api)
            created = api.post("/keys", json={"name": "load", "models": ["*"]})
            assert created.status_code == 200, created.text
        yield Fleet(server, agent, str(created.json()["key"]), tmp)
    finally:
        orphans = agents.close()
        servers.close()
    if orphans:
        pytest.fail("llama-server processes outlived their agents (killed now):\n" + "\n".join(orphans))


def delete_after(fleet: Fleet, name: str) -> Callable[[], None]:
    def delete() -> None:
        with fleet.server.client(timeout=10) as api:
            api.delete(f"/deployments/{name}")
        # Its engines stop: the next test has the node's cores to itself.
        wait_for(lambda: not fleet.replicas(name), timeout=30, what=f"{name}'s replicas to go")

    return delete


def test_load_scales_up_to_max_and_back_down_after_the_cooldown(
    fleet: Fleet, request: pytest.FixtureRequest
) -> None:
    name, cooldown = "elastic", 5.0
    [doc] = elastic_documents(name)
    doc["replicas"] = {"min": 1, "max": 2}
    doc["autoscale"] = {"target": 2, "scaleDownCooldownSeconds": cooldown}
    t0 = time.monotonic()
    fleet.server.apply([doc])
    request.addfinalizer(delete_after(fleet, name))
    first = wait_for(lambda: fleet.serving(name), timeout=60, what=f"{name} to serve")
    assert len(first) == 1, first
    time.sleep(ROUTE_REFRESH)
    assert find(fleet.decisions(name), "BelowMin", 0, 1) is not None, fleet.decisions(name)
    print(f"\n{name}: 1 replica serving {time.monotonic() - t0:.1f} s after apply")

    # --- load: 4 workers, each sending slow requests back to back ------------------------------
    stop = threading.Event()
    statuses: list[int] = []
    failures: list[str] = []

    def worker(i: int) -> None:
        with fleet.http(timeout=60) as http:
            n = 0
            while not stop.is_set():
                body = slow_chat(name, f"w{i} r{n}")
                try:
                    statuses.append(http.post("/chat/completions", json=body).status_code)
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                n += 1

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
    load_started = time.monotonic()
    for w in workers:
        w.start()
    try:
        up = wait_for(
            lambda: find(fleet.decisions(name), "LoadAboveTarget", 1, 2, after=load_started),
            timeout=30,
            what="the autoscaler to scale elastic up (LoadAboveTarget 1 -> 2)",
            interval=0.2,
        )
        both = wait_for(
            lambda: s if len(s := fleet.serving(name)) == 2 else None,
            timeout=60,
            what="a second elastic replica to be Running",
            interval=0.2,
        )
        second_running = time.monotonic()
        # The load goes on over both replicas for a while: the count holds at 2.
        time.sleep(ROUTE_REFRESH + 2.0)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    load_stopped = time.monotonic()
    during_load = fleet.decisions(name)
    described_up = fleet.describe(name)
    print(
        f"load of 4 slow requests from +{load_started - t0:.1f}s: scale-up decision "
        f"{up['at'] - load_started:.2f} s after the load started, second replica Running "
        f"{second_running - load_started:.1f} s after it; load stopped at +{load_stopped - t0:.1f}s "
        f"({len(statuses)} requests: {sorted(set(statuses))}, {len(failures)} failures)"
    )
    assert not failures and statuses and set(statuses) == {200}, (failures, statuses)
    assert set(first) < set(both)
    assert up["load"] >= 3 and up["wanted"] == 2, up
    # Nothing scaled down while the load was on.
    assert not [d for d in during_load if d["desired"] < d["previous"] and d["at"] >= up["at"]], render_log(
        during_load, t0
    )
    assert find(described_up["status"]["autoscaler"], "LoadAboveTarget", 1, 2) is not None, described_up

    # --- the load is gone: back to 1 after the cooldown ----------------------------------------
    down = wait_for(
        lambda: find(fleet.decisions(name), "LoadBelowTargetAfterCooldown", 2, 1, after=up["at"]),
        timeout=30,
        what="the autoscaler to scale elastic down (LoadBelowTargetAfterCooldown 2 -> 1)",
        interval=0.2,
    )
    one = wait_for(
        lambda: s if len(fleet.replicas(name)) == 1 and len(s := fleet.serving(name)) == 1 else None,
        timeout=30,
        what="elastic to be back at one replica",
        interval=0.2,
    )
    wait_for(
        lambda: fleet.engine_ports() == set(one.values()),
        timeout=20,
        what="the released replica's llama-server to exit",
    )
    back_at_one = time.monotonic()
    described = fleet.describe(name)
    log = described["status"]["autoscaler"]
    print(
        f"scale-down decision {down['at'] - load_stopped:.2f} s after the load stopped (waited "
        f"{down['waited']:.2f} s of the {cooldown:g} s cooldown); one replica and one engine left "
        f"{back_at_one - load_stopped:.1f} s after the load stopped"
    )
    print(f"decision log of {name} (fleetserve describe deployment {name} -o json, status.autoscaler):")
    print(render_log(log, t0))
    assert down["waited"] >= cooldown, down
    assert down["at"] >= second_running, down
    assert find(log, "LoadBelowTargetAfterCooldown", 2, 1) is not None, log
    assert find(log, "LoadAboveTarget", 1, 2) is not None, log
    assert described["status"]["desiredReplicas"] == 1, described["status"]
    assert len(described["replicas"]) == 1 and described["replicas"][0]["name"] in one


def test_scale_to_zero_when_idle_and_a_held_request_brings_a_replica_back(
    fleet: Fleet, request: pytest.FixtureRequest
) -> None:
    name, idle_after = "scratch", 3.0
    [doc] = elastic_documents(name)
    doc["replicas"] = {"min": 0, "max": 1}
    doc["autoscale"] = {"scaleToZeroAfterSeconds": idle_after, "scaleDownCooldownSeconds": idle_after}
    t0 = time.monotonic()
    fleet.server.apply([doc])
    request.addfinalizer(delete_after(fleet, name))

    # A min-0 deployment starts at zero: the autoscaler's first count is what exists (nothing).
    start = wait_for(lambda: fleet.decisions(name), timeout=10, what=f"a decision for {name}")
    assert start[0]["desired"] == 0 and start[0]["reason"] == "Steady", start
    time.sleep(ROUTE_REFRESH)  # the gateway has a route for it (listed: it scales from zero)
    with fleet.http() as http:
        assert name in {m["id"] for m in http.get("/models").json()["data"]}
    assert fleet.replicas(name) == []

    def ask(i: int) -> tuple[float, str]:
        sent = time.monotonic()
        with fleet.openai() as client:
            raw = client.chat.completions.with_raw_response.create(
                model=name,
                messages=[{"role": "user", "content": f"Are you awake? ({i})"}],
                max_tokens=8,
                extra_body={"ignore_eos": True},
            )
        took = time.monotonic() - sent
        assert raw.status_code == 200, raw.text
        answer = raw.parse()
        assert answer.usage is not None and answer.usage.completion_tokens == 8
        assert answer.choices[0].message.content
        return took, answer.id

    # --- the first request: held while the first replica starts ----------------------------------
    sent_1 = time.monotonic()
    held_1, _ = ask(1)
    answered_1 = time.monotonic()
    wake_1 = find(fleet.decisions(name), "HeldRequest", 0, 1, after=sent_1)
    assert wake_1 is not None, fleet.decisions(name)

    # --- idle: back to zero ----------------------------------------------------------------------
    idle = wait_for(
        lambda: find(fleet.decisions(name), "Idle", 1, 0, after=wake_1["at"]),
        timeout=30,
        what=f"{name} to scale to zero (Idle)",
        interval=0.2,
    )
    wait_for(
        lambda: not fleet.replicas(name) and not fleet.engine_ports(),
        timeout=30,
        what=f"{name}'s replica and its llama-server to go",
        interval=0.2,
    )
    zero_at = time.monotonic()
    time.sleep(ROUTE_REFRESH)  # the gateway's route has no endpoint left

    # --- the next request: held while a replica starts again -------------------------------------
    sent_2 = time.monotonic()
    held_2, _ = ask(2)
    wake_2 = find(fleet.decisions(name), "HeldRequest", 0, 1, after=sent_2)
    serving = fleet.serving(name)
    described = fleet.describe(name)
    log = described["status"]["autoscaler"]
    print(
        f"\n{name}: first request held and answered in {held_1:.2f} s (HeldRequest decision "
        f"{wake_1['at'] - sent_1:.2f} s after it was sent); Idle decision {idle['at'] - answered_1:.2f} s "
        f"after the answer ({idle['waited']:.2f} s since the request arrived, scale to zero after "
        f"{idle_after:g} s); replica and engine gone {zero_at - idle['at']:.2f} s after the decision"
    )
    print(
        f"{name}: request after scale-to-zero held and answered in {held_2:.2f} s (HeldRequest decision "
        f"{wake_2['at'] - sent_2 if wake_2 else float('nan'):.2f} s after it was sent)"
    )
    print(f"decision log of {name} (fleetserve describe deployment {name} -o json, status.autoscaler):")
    print(render_log(log, t0))
    assert wake_2 is not None, render_log(fleet.decisions(name), t0)
    assert idle["waited"] >= idle_after, idle
    assert idle["at"] >= answered_1 - 0.5, "scaled to zero while the request was served"
    assert find(log, "Idle", 1, 0) is not None and find(log, "HeldRequest", 0, 1, after=idle["at"]), log
    assert len(serving) == 1, serving
    # Held, not refused: a replica start takes far less than the 30 s hold deadline, far more than
    # an answer of the tiny model (milliseconds).
    assert 0.3 < held_1 < 30 and 0.3 < held_2 < 30, (held_1, held_2)


def test_a_replica_that_just_started_is_not_counted_as_loaded(
    fleet: Fleet, request: pytest.FixtureRequest
) -> None:
    """``burst``: ``{min: 1, max: 3}``, target 2, the same load of 4 as ``elastic``. The load needs
    2 replicas, and 2 is where the count must stay while the load lasts. A replica that has just
    turned Ready has not been scraped yet: its load is unknown, and the requests in flight are
    still all on the old replica (the gateway's routes refresh every second). Counting it at the
    reporting replicas' mean (4 × 2 Ready = 8) asks for 4 replicas that the load never needed."""
    name = "burst"
    [doc] = elastic_documents(name)
    doc["replicas"] = {"min": 1, "max": 3}
    doc["autoscale"] = {"target": 2, "scaleDownCooldownSeconds": 5}
    t0 = time.monotonic()
    fleet.server.apply([doc])
    request.addfinalizer(delete_after(fleet, name))
    wait_for(lambda: len(fleet.serving(name)) == 1, timeout=60, what=f"{name} to serve")
    time.sleep(ROUTE_REFRESH)

    stop = threading.Event()
    statuses: list[int] = []

    def worker(i: int) -> None:
        with fleet.http(timeout=60) as http:
            n = 0
            while not stop.is_set():
                body = slow_chat(name, f"b{i} r{n}")
                with contextlib.suppress(httpx.HTTPError):
                    statuses.append(http.post("/chat/completions", json=body).status_code)
                n += 1

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
    load_started = time.monotonic()
    for w in workers:
        w.start()
    try:
        wait_for(
            lambda: find(fleet.decisions(name), "LoadAboveTarget", 1, 2, after=load_started),
            timeout=30,
            what=f"{name} to scale up to 2",
            interval=0.2,
        )
        wait_for(lambda: len(fleet.serving(name)) == 2, timeout=60, what=f"a second {name} replica")
        time.sleep(ROUTE_REFRESH + 2.0)  # both replicas scraped, the load spread over them
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    log = fleet.decisions(name)
    print(f"\ndecision log of {name} under a load of 4 at target 2 (max 3):")
    print(render_log(log, t0))
    assert set(statuses) == {200}, statuses
    beyond = [d for d in log if d["desired"] > 2]
    assert not beyond, (
        f"{name} was asked for {beyond[0]['desired']} replicas by a load of 4 at target 2 "
        f"({beyond[0]['reason']}: load {beyond[0]['load']:g} with {beyond[0]['ready']} Ready, "
        f"{beyond[0]['reported']} reporting):\n{render_log(log, t0)}"
    )
