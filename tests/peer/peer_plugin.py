"""The pytest plugin (``-p peer_plugin``) the peer suite loads into llama.cpp's server tests.

The test files run unchanged. This plugin does three things, and nothing else:

1. Selection: deselects the tests ``peer_exclusions`` lists (they need Hub models not here) and,
   with ``PEER_ONLY`` (a JSON list of test ids), every test not in it.
2. Model presets: ``ServerPreset.load_all`` (the suite's session fixture starts every preset once,
   online, to fill the model cache) starts only the presets whose model the loopback Hub serves
   (``PEER_SERVED``, JSON ``{repo: file}``); in the gateway run none (the wrapper fetches the model
   each time, so there is no cache to fill). Without this the first preset of a model that is not
   here would fail the session.
3. Authentication, in the gateway run only (``PEER_STATE`` set): the tests send no API key, or
   ``dummy``, or their own ``--api-key``. Every request to the server under test (``PORT``) gets
   fleetserve's API key, which the wrapper wrote to ``PEER_STATE``: without ``--api-key``,
   ``Authorization: Bearer KEY`` on every request (llama-server then ignores any key, as the
   gateway must not); with ``--api-key K``, the test's K (``Authorization: Bearer K`` or
   ``X-Api-Key: K``) becomes KEY and any other key, or none, goes as the test sent it. Requests go
   through ``requests`` (``HTTPAdapter.send``) and the ``openai`` client (the transports of
   ``httpx2``, which it sends with, and of ``httpx``).

It writes each test's outcome to ``PEER_OUTCOMES`` (JSON lines). With ``PEER_ROUTES`` set, it
also appends each request to the server under test (test id, method, path, the JSON body's
``model`` and ``stream``) to that file, so a report can say what a test asks of the server.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from peer_exclusions import excluded

_current_test = ""


def _server_port() -> int:
    return int(os.environ.get("PORT", "8080"))


def _state() -> dict[str, Any] | None:
    """The wrapper's key; None while the stack of this start has none (the wrapper writes it before
    it deploys the model, so no request the gateway could route goes without it)."""
    try:
        state: dict[str, Any] = json.loads(Path(os.environ["PEER_STATE"]).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return state


def _to_server(url: str) -> bool:
    parts = urlsplit(url)
    return parts.port == _server_port() and parts.hostname in ("127.0.0.1", "localhost", "::1")


def _authorize(headers: MutableMapping[str, str]) -> None:
    state = _state()
    if state is None:
        return
    key, asked = state["key"], state.get("api_key_arg")
    if asked is None:
        headers["Authorization"] = f"Bearer {key}"
        return
    if headers.get("Authorization") == f"Bearer {asked}":
        headers["Authorization"] = f"Bearer {key}"
    if headers.get("X-Api-Key") == asked:
        headers["X-Api-Key"] = key


def _record(method: str, url: str, body: Any) -> None:
    """The request's test, method, path, and for a JSON body its ``model`` and ``stream``."""
    routes = os.environ.get("PEER_ROUTES")
    if not routes:
        return
    try:
        document = json.loads(body) if body else None
    except (ValueError, TypeError):
        document = None
    facts = {}
    if isinstance(document, dict):
        facts = {"model": document.get("model"), "stream": bool(document.get("stream"))}
    with open(routes, "a", encoding="utf-8") as out:
        out.write(json.dumps([_current_test, method, urlsplit(url).path, facts]) + "\n")


def _seen(method: str, url: str, headers: MutableMapping[str, str], body: Any) -> None:
    if not _to_server(url):
        return
    _record(method, url, body)
    if os.environ.get("PEER_STATE"):
        _authorize(headers)


def _patch_clients() -> None:
    import httpx
    import requests.adapters

    requests_send = requests.adapters.HTTPAdapter.send

    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _seen(request.method or "", request.url or "", request.headers, request.body)
        return requests_send(self, request, *args, **kwargs)

    requests.adapters.HTTPAdapter.send = send  # type: ignore[method-assign]

    # The openai client sends with httpx2 (a fork of httpx); other code may use httpx.
    for module in (httpx, *([sys.modules["httpx2"]] if _import("httpx2") else [])):
        _patch_httpx_transports(module)


def _import(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def _patch_httpx_transports(module: Any) -> None:
    sync_handle = module.HTTPTransport.handle_request
    async_handle = module.AsyncHTTPTransport.handle_async_request

    def handle(self: Any, request: Any) -> Any:
        _seen(request.method, str(request.url), request.headers, request.content)
        return sync_handle(self, request)

    async def handle_async(self: Any, request: Any) -> Any:
        _seen(request.method, str(request.url), request.headers, request.content)
        return await async_handle(self, request)

    module.HTTPTransport.handle_request = handle
    module.AsyncHTTPTransport.handle_async_request = handle_async


def _patch_presets() -> None:
    utils = sys.modules.get("utils")
    if utils is None:
        import utils  # the suite's own module, beside its conftest.py
    presets = utils.ServerPreset
    served: dict[str, str | None] = json.loads(os.environ.get("PEER_SERVED", "{}"))
    gateway = bool(os.environ.get("PEER_STATE"))

    def load_all() -> None:
        if gateway:
            return
        for name in list(vars(presets)):
            if name == "load_all" or not callable(getattr(presets, name)):
                continue
            server = getattr(presets, name)()
            repo = (server.model_hf_repo or "").partition(":")[0]
            if repo not in served or server.model_hf_file not in (None, served[repo]):
                continue
            server.offline = False
            server.start()
            server.stop()

    presets.load_all = staticmethod(load_all)


def pytest_configure(config: pytest.Config) -> None:
    _patch_clients()
    _patch_presets()


def _selected(nodeid: str) -> bool:
    if excluded(nodeid) is not None:
        return False
    only = os.environ.get("PEER_ONLY")
    return not only or nodeid in json.loads(Path(only).read_text(encoding="utf-8"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept = [item for item in items if _selected(item.nodeid)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if not _selected(item.nodeid)])
        items[:] = kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's outcome by its exact id (``PEER_OUTCOMES``): its call's, or ``error`` when its
    setup or teardown failed."""
    path = os.environ.get("PEER_OUTCOMES")
    if not path or not (report.when == "call" or report.failed or report.skipped):
        return
    outcome = report.outcome if report.when == "call" else "error" if report.failed else "skipped"
    crash = getattr(report.longrepr, "reprcrash", None)
    why = str(getattr(crash, "message", "")).splitlines()[0][:300] if report.failed and crash else ""
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps([report.nodeid, outcome, why]) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current_test
    _current_test = item.nodeid
