"""One deployment the database cannot store a replica of must not stop reconciling for the rest.

Validation accepts any positive CPU core count, but ``replica_shards.cpu_cores`` is a 32-bit
integer on PostgreSQL and a 64-bit one on SQLite. A replica claiming 10^19 cores (a typo with
too many zeros, on a node that declares even more) cannot be written. Acceptable answers: the
apply is refused with a 4xx naming the field, or the replica is reported and the other
deployments are still placed. Not acceptable: the reconciler thread dying (SQLite: an
OverflowError escapes ``run_forever``) or every cycle failing at that replica (PostgreSQL), so
that nothing else is ever placed again while the API still answers.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow

ABSURD = 10**19


def docs(replicas: int) -> list[dict]:
    return [
        {"kind": "Node", "name": "huge", "cpu": {"cores": 10 * ABSURD, "memory": "1TiB"}},
        {"kind": "Node", "name": "small", "cpu": {"cores": 8, "memory": "64GiB"}},
        {
            "kind": "Model",
            "name": "m",
            "format": "gguf",
            "size": "1GB",
            "architecture": {"layers": 2, "kvHeads": 1, "headDim": 64, "contextLength": 256},
        },
        {
            "kind": "Deployment",
            "name": "a-typo",
            "model": "m",
            "replicas": 1,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": ABSURD}}],
        },
        {
            "kind": "Deployment",
            "name": "b-normal",
            "model": "m",
            "replicas": replicas,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2}}],
        },
    ]


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request, tmp_path) -> str:
    if request.param == "postgres":
        return request.getfixturevalue("pg_database")
    return f"sqlite:///{tmp_path / 'state.db'}"


def test_an_unstorable_replica_does_not_stop_the_reconciler(servers, database_url, eventually):
    server = servers.start(database_url, name="liveness", reconcile_interval=0.1)
    with server.client() as api:
        first = api.post("/apply", json={"documents": docs(1)})
        assert first.status_code < 500, first.text
        if first.status_code != 200:
            # Refused at the door: fine, if it says which field; the rest must still work.
            assert first.status_code == 422 and "cores" in first.text, first.text
            applied = api.post("/apply", json={"documents": [d for d in docs(1) if d["name"] != "a-typo"]})
            assert applied.status_code == 422 or applied.status_code == 200, applied.text
            if applied.status_code == 422:  # the absurd node itself refused too
                kept = [d for d in docs(1) if d["name"] not in ("a-typo", "huge")]
                assert api.post("/apply", json={"documents": kept}).status_code == 200

        def placed(n: int) -> bool:
            return len(api.get("/replicas", params={"deployment": "b-normal"}).json()) == n

        # Cycles every 0.1 s with the bad replica in the plan (on PostgreSQL the reconciler is a
        # process of its own, which takes a second or two to start).
        eventually(lambda: placed(1), timeout=15, what="b-normal placed beside the unstorable replica")
        time.sleep(1.0)  # ten more such cycles
        for crash in ("Exception in thread reconciler", "reconciler process exited unasked"):
            assert crash not in server.log(), server.log()[-3000:]
        # And the reconciler still acts on later changes.
        scaled = api.post("/apply", json={"documents": [docs(3)[-1]]})
        assert scaled.status_code == 200, scaled.text
        eventually(lambda: placed(3), timeout=10, what="b-normal to scale to 3")
    assert server.alive()
