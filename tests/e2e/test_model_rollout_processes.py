"""A Model's change rolls its replicas, with real processes: a real ``fleetserve server``
(SQLite), two real agents on this machine's CPU running the real llama-server on the tiny GGUF,
clients through the server's own /v1 gateway under load the whole time.

The Model is applied again with other weights (another file of the tiny model, with its sha256):
every replica of the deployment serving it is replaced with surge and drain (``fleetserve rollout
status`` says why: the weights of model tiny changed); ``fleetserve rollout undo model/tiny``
rolls them back to the first revision. 0 failed and 0 truncated requests throughout; the counts
(sent / completed / failed / truncated) are printed.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from pathlib import Path

import pytest
from e2e_support import AgentFactory, ServerFactory, cli_env, run_cli, tiny_documents, wait_for
from test_lifecycle_processes import api_key, deployment_view, leaked, running, start

from load import LoadCounts, run_load

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    out = run_cli("dev", "tiny-model", str(path))
    assert out.returncode == 0 and path.exists(), out.stderr
    return path


def test_a_models_new_weights_roll_its_replicas_under_load_losing_no_request_and_undo_rolls_back(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    server = start(servers, agents, tmp_path, ["node-a", "node-b"])
    docs = tiny_documents(tiny_model, replicas=2)
    server.apply(docs)
    wait_for(lambda: running(server, "tiny", 2), timeout=120, what="two tiny replicas to run")
    first = deployment_view(server, "tiny")["revision"]
    old_replicas = {r["name"] for r in deployment_view(server, "tiny")["replicas"]}
    headers = api_key(server)
    env = cli_env(server, tmp_path)
    # Other weights: another file, named by its digest. The deployment itself is not applied again.
    second = tmp_path / "tiny-v2.gguf"
    shutil.copyfile(tiny_model, second)
    digest = hashlib.sha256(second.read_bytes()).hexdigest()
    changed = {**docs[0], "source": str(second), "sha256": digest}

    stop = threading.Event()
    load: dict[str, LoadCounts] = {}
    loader = threading.Thread(
        target=lambda: load.setdefault(
            "counts", run_load(server.url + "/v1", "tiny", stop, headers=headers, workers=2)
        )
    )
    loader.start()
    time.sleep(1.0)
    server.apply([changed])
    started = time.monotonic()
    out = run_cli("rollout", "status", "tiny", "--timeout", "180", env=env, timeout=200)
    rolled = time.monotonic() - started
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the weights of model tiny changed" in out.stdout, out.stdout
    assert "rolled out" in out.stdout.splitlines()[-1], out.stdout
    view = deployment_view(server, "tiny")
    assert view["revision"] != first
    assert view["revision"].split(".")[0] == first.split(".")[0], "the deployment's own part is the same"
    assert all(r["revision"] == view["revision"] for r in view["replicas"])
    assert not old_replicas & {r["name"] for r in view["replicas"]}, "every replica was replaced"

    out = run_cli("rollout", "undo", "model/tiny", env=env)
    assert out.returncode == 0, out.stderr
    assert f"rolled back to weights {first.split('.')[1]}" in out.stdout, out.stdout
    out = run_cli("rollout", "status", "tiny", "--timeout", "180", env=env, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    stop.set()
    loader.join(120)
    counts = load["counts"]
    view = deployment_view(server, "tiny")
    print(
        f"model rollout: {rolled:.1f} s; under load {counts.summary()}; "
        f"leaked allocations {leaked(server, 'tiny', 2)}"
    )
    assert view["revision"] == first
    assert counts.completed > 0 and counts.failed == 0 and counts.truncated == 0, counts.errors
    assert leaked(server, "tiny", 2) == 0
