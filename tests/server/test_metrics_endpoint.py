"""/metrics publishes the GPU samples agents report, and fleetserve's own reconcile figures."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from fastapi.testclient import TestClient

from fleetserve.server.agents.enrolment import EnrolmentPolicy
from fleetserve.server.app import create_app
from fleetserve.spec.resources import Node
from fleetserve.store.credentials import TokenKind
from fleetserve.store.sql import SqlStore


def test_gpu_samples_an_agent_reports_appear_on_metrics(tmp_path):
    with SqlStore.open(tmp_path / "state.db") as store:
        join = store.create_token(TokenKind.JOIN, datetime.now(UTC)).plaintext
        node = Node.model_validate(
            {
                "name": "halo",
                "cpu": {"cores": 16, "memory": "128GiB"},
                "devices": [{"index": 0, "class": "amd-gfx1151"}],
            }
        )
        app = create_app(store, models_dir=tmp_path / "models", enrolment=EnrolmentPolicy(approve_new=True))
        with TestClient(app) as client:
            enrolled = client.post("/api/v1/agent/register", json=node.model_dump(mode="json", by_alias=True),
                                   headers={"Authorization": f"Bearer {join}"}).json()  # fmt: skip
            epoch = enrolled["epoch"]
            headers = {"Authorization": f"Bearer {enrolled['credential']}"}
            sample = {
                "name": "fleetserve_gpu_utilization_ratio",
                "labels": {"node": "halo", "device": "0", "driver": "gpu.amd.com", "class": "amd-gfx1151"},
                "value": 0.25,
            }
            report = {"node": "halo", "epoch": epoch, "gpuMetrics": [sample]}
            assert client.post("/api/v1/agent/status", json=report, headers=headers).status_code == 200
            bad = {**report, "gpuMetrics": [{**sample, "name": "vllm:num_requests_running"}]}
            assert client.post("/api/v1/agent/status", json=bad, headers=headers).status_code == 422
            deadline = time.monotonic() + 10
            text = ""
            while time.monotonic() < deadline:
                text = client.get("/metrics").text
                if "fleetserve_gpu_utilization_ratio{" in text:
                    break
                time.sleep(0.2)
            line = next(x for x in text.splitlines() if x.startswith("fleetserve_gpu_utilization_ratio{"))
            assert 'driver="gpu.amd.com"' in line and line.endswith(" 0.25")
