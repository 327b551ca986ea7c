"""Fixtures of the Kubernetes backend's tests (the fake API server is in fake_apiserver.py).

- ``fake_api``: a LABELLED FAKE of the Kubernetes API endpoints fleetserve uses, on 127.0.0.1
  (no real API server can run here); stopped at teardown.
- ``kube_api``: an official-client ``ApiClient`` made by ``fleetserve.kube.apply.api_client`` from a
  kubeconfig naming the fake; closed at teardown.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_apiserver import FakeApiServer, running_fake_apiserver
from kubernetes import client

from fleetserve.kube.apply import api_client


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    with running_fake_apiserver() as server:
        yield server


@pytest.fixture
def kube_api(fake_api: FakeApiServer, tmp_path: Path) -> Iterator[client.ApiClient]:
    api = api_client(kubeconfig=fake_api.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        yield api
    finally:
        api.close()
