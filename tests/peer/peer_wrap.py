"""``llama-server`` as llama.cpp's server tests start it, served through fleetserve instead.

The peer suite points ``LLAMA_SERVER_BIN_PATH`` at a script that runs this module with the test's
llama-server argv. The gateway run has one fleetserve stack (``peer_stack``: server, gateway and
agent, as ``fleetserve up`` starts them) listening on the tests' port (``PEER_STACK_URL``, admin
token ``PEER_ADMIN_TOKEN``). For each start the wrapper empties that fleet (every deployment
deleted, its engine gone, every key revoked), applies one Model and one Deployment that carry the
test's model and flags, waits for the replica and for the gateway's route to it, creates an API
key, and stays up until SIGTERM (the test's ``server.stop()``).

How the test's argv maps (``split_argv``):

- ``--host``/``--port``: must be the stack's listener (the wrapper exits 3 otherwise: the test's
  server "died"); ``--cors-origins`` is a server option the shared stack does not take (ignored,
  said in the log; only router-mode tests, all excluded, pass it);
- ``--hf-repo``/``--hf-file`` (or ``--model``): the GGUF, fetched here from the same Hub
  llama-server would use (``MODEL_ENDPOINT``, else ``HF_ENDPOINT``) into the agent's model folder
  (``PEER_MODELS_DIR``) and deployed from there; ``--offline`` is llama-server's cache policy and has no counterpart;
- ``--alias``: the deployment's name (the model name the gateway serves): its first alias when
  it lists several; without one, the file name;
- ``--ctx-size``: the profile's ``context``;
- ``--api-key K``: fleetserve's API key stands for K (the suite's plugin sends the real key where a
  request carries K; a request without it, or with another key, goes as the test sent it);
- ``--parallel``, ``--threads``, ``--n-gpu-layers``, ``--slots``/``--no-slots``, ``--metrics``,
  ``--kv-unified``: fleetserve's launch sets these itself (``engines/llamacpp.py``), so they are
  dropped and listed in the log;
- ``--embeddings``, ``--reranking``: the deployment's ``task`` (embed, rerank), which starts them;
- every other flag and its value: the profile's ``engineArgs`` as given (short forms spelled long,
  paths made absolute).
  A flag the engine row does not allow makes the apply fail: the wrapper exits 3 saying which,
  and the test sees its server die. The profile asks for one CPU core.

Before it deploys, the wrapper writes the key (and K) to ``PEER_STATE`` for the plugin. If the gateway then
answers the tests' readiness probe ``GET /health`` with 404 (no such route), the test's wait could
never end: the wrapper says so and exits 4 at once instead of letting it time out after 60 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from peer_stack import Admin, StackError, wait

# llama-server flags the tests pass with a value (tools/server/tests/utils.py, ServerProcess.start).
VALUE_FLAGS = frozenset(
    {
        "--port", "--temp", "--seed", "--host", "--model", "-m", "--model-url", "--model-draft",
        "--hf-repo", "--hf-file", "--models-dir", "--models-max", "--models-preset", "--cors-origins",
        "--batch-size", "--ubatch-size", "--threads", "--n-gpu-layers", "--pooling", "--alias",
        "--tags", "--ctx-size", "--parallel", "-ctk", "-ctv", "-fa", "--n-predict", "--slot-save-path",
        "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-type", "--api-key", "--spec-draft-n-max",
        "--spec-draft-n-min", "--spec-synth-len", "--spec-synth-rates", "--reasoning-format",
        "--reasoning", "--chat-template", "--chat-template-file", "--mmproj-url", "--media-path",
        "--sleep-idle-seconds", "--cache-ram", "--tools", "--tools-runtime", "--mcp-servers-config",
        "--mcp-servers-json",
    }
)  # fmt: skip
# Set by fleetserve's llama.cpp launch itself: the test's values are dropped.
FLEETSERVE_SETS = frozenset(
    {"--parallel", "--threads", "--n-gpu-layers", "--slots", "--no-slots", "--metrics", "--kv-unified"}
)
# Flags that are a deployment's task in fleetserve (``task:``), never engineArgs.
TASK_FLAGS = {"--embedding": "embed", "--embeddings": "embed", "--rerank": "rerank", "--reranking": "rerank"}
# Flags whose value is a path: made absolute here (the engine runs in another folder).
PATH_FLAGS = frozenset({"--chat-template-file", "--slot-save-path", "--media-path", "--model", "--lora"})
LONG_FORMS = {"-ctk": "--cache-type-k", "-ctv": "--cache-type-v", "-fa": "--flash-attn", "-m": "--model"}
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080


@dataclass
class Request:
    """What the test's argv asks of the stack."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    hf_repo: str | None = None
    hf_file: str | None = None
    model_file: str | None = None
    alias: str | None = None
    context: int | None = None
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    engine_args: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    # The deployment's task: --embeddings is task embed, --reranking task rerank (which wins: it
    # implies embeddings), as fleetserve starts them itself.
    task: str = "generate"


def split_argv(argv: list[str]) -> Request:
    """The test's llama-server argv, mapped onto the stack (the module's docstring says how)."""
    req = Request()
    i = 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if flag in VALUE_FLAGS and i + 1 < len(argv) else None
        i += 2 if value is not None else 1
        flag = LONG_FORMS.get(flag, flag)
        if flag in PATH_FLAGS and value is not None:
            value = str(Path(value).absolute())
        if flag == "--host" and value is not None:
            req.host = value
        elif flag == "--port" and value is not None:
            req.port = int(value)
        elif flag == "--hf-repo":
            req.hf_repo = value
        elif flag == "--hf-file":
            req.hf_file = value
        elif flag == "--model":
            req.model_file = value
        elif flag == "--alias":
            req.alias = value
        elif flag == "--ctx-size" and value is not None:
            req.context = int(value)
        elif flag == "--api-key":
            req.api_key = value
        elif flag == "--cors-origins" and value is not None:
            req.cors_origins = tuple(o.strip() for o in value.split(",") if o.strip())
        elif flag == "--offline":
            pass
        elif flag in TASK_FLAGS:
            if req.task != "rerank":
                req.task = TASK_FLAGS[flag]
        elif flag in FLEETSERVE_SETS:
            req.dropped += [flag] + ([value] if value is not None else [])
        else:
            req.engine_args += [flag] + ([value] if value is not None else [])
    return req


def deployment_name(req: Request) -> str:
    """The (first) alias, else the GGUF's file name without ``.gguf``, as a valid fleetserve name."""
    raw = (req.alias or "").partition(",")[0] or (
        req.hf_file or req.model_file or req.hf_repo or "model"
    ).rpartition("/")[2]
    name = re.sub(r"[^a-z0-9.-]+", "-", re.sub(r"\.gguf$", "", raw, flags=re.I).lower()).strip("-.")
    return name[:63].strip("-.") or "model"


def fetch_model(req: Request, into: Path) -> Path:
    """The test's GGUF as a local file: ``--model`` as is, else downloaded from the Hub llama-server
    would use (``MODEL_ENDPOINT``, else ``HF_ENDPOINT``); a repository without ``--hf-file`` gives
    its first GGUF, as llama-server does when no quantisation tag matches."""
    if req.model_file is not None:
        return Path(req.model_file).absolute()
    if req.hf_repo is None:
        raise SystemExit("peer_wrap: no model (--hf-repo or --model) in the test's arguments")
    endpoint = (os.environ.get("MODEL_ENDPOINT") or os.environ.get("HF_ENDPOINT") or "").rstrip("/")
    if not endpoint:
        raise SystemExit("peer_wrap: MODEL_ENDPOINT is not set: the suite runs against its loopback Hub")
    repo = req.hf_repo.partition(":")[0]
    with httpx.Client(base_url=endpoint, timeout=30) as hub:
        name = req.hf_file
        if name is None:
            tree = hub.get(f"/api/models/{repo}/tree/main", params={"recursive": "true"})
            ggufs = [f["path"] for f in tree.json() if str(f.get("path", "")).endswith(".gguf")]
            if tree.status_code != 200 or not ggufs:
                raise SystemExit(f"peer_wrap: {repo} has no GGUF on {endpoint} ({tree.status_code})")
            name = ggufs[0]
        got = hub.get(f"/{repo}/resolve/main/{name}")
        if got.status_code != 200:
            raise SystemExit(f"peer_wrap: {repo}/{name} not on {endpoint} ({got.status_code})")
    path = into / name.rpartition("/")[2]
    path.write_bytes(got.content)
    return path


def _stopping(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(req: Request, admin: Admin, url: str, models: Path, state: Path | None) -> int:
    """Deploy the test's model and flags on the emptied fleet, publish the key, wait for SIGTERM."""
    t0 = time.monotonic()
    admin.clear()
    t1 = time.monotonic()
    name = deployment_name(req)
    profile: dict[str, Any] = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}
    if req.context is not None:
        profile["context"] = req.context
    if req.engine_args:
        profile["engineArgs"] = req.engine_args
    # The key first: the plugin has it before the gateway can route any request of the test.
    key = admin.key()
    if state is not None:
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "api_key_arg": req.api_key, "pid": os.getpid()}))
        tmp.replace(state)
    admin.deploy(name, fetch_model(req, models), profile, task=req.task)
    t2 = time.monotonic()

    # The gateway routes to the replica once its table has it: /v1/models lists what it routes.
    def listed() -> bool:
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
        return any(m["id"] == name for m in models["data"])

    wait("the gateway's route to the replica", listed, 30)
    t3 = time.monotonic()
    probe = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    if probe.status_code == 404:
        print(
            "peer_wrap: the gateway answers GET /health with 404: the test's readiness probe would "
            f"never succeed ({probe.text[:200]}); up after {t3 - t0:.1f} s (emptying the fleet "
            f"{t1 - t0:.1f} s, the replica {t2 - t1:.1f} s, the route {t3 - t2:.1f} s)",
            flush=True,
        )
        return 4
    print(
        f"peer_wrap: ready on {url} as {name!r} after {time.monotonic() - t0:.1f} s (emptying the fleet "
        f"{t1 - t0:.1f} s, the replica {t2 - t1:.1f} s, the route {time.monotonic() - t2:.1f} s)",
        flush=True,
    )
    while True:
        time.sleep(0.5)
        if httpx.get(f"{url}/healthz", timeout=5).status_code != 200:
            print("peer_wrap: the fleetserve server stopped answering", flush=True)
            return 5


def main(argv: list[str]) -> int:
    req = split_argv(argv)
    state = Path(os.environ["PEER_STATE"]) if os.environ.get("PEER_STATE") else None
    if state is not None:
        state.unlink(missing_ok=True)
    url = os.environ["PEER_STACK_URL"]
    print(
        f"peer_wrap: engineArgs {req.engine_args}; dropped (fleetserve sets them) {req.dropped}", flush=True
    )
    if f"http://{req.host}:{req.port}" != url:
        print(
            f"peer_wrap: the test asks for a listener on {req.host}:{req.port}; the stack's gateway is {url}"
        )
        return 3
    if req.cors_origins:
        print(
            f"peer_wrap: --cors-origins {req.cors_origins} ignored: the stack's server has none", flush=True
        )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stopping)
    admin = Admin(url, os.environ["PEER_ADMIN_TOKEN"])
    try:
        return serve(req, admin, url, Path(os.environ["PEER_MODELS_DIR"]), state)
    except StackError as e:
        print(f"peer_wrap: {e}", flush=True)
        return 3
    except KeyboardInterrupt:
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        # This start's key goes with it: the next test's first readiness probe, sent before its
        # wrapper has emptied the fleet, must not reach this test's engine (it would pass with the
        # wrong engine). The fleet is emptied too, so the next start has less to stop.
        if state is not None:
            state.unlink(missing_ok=True)
        with contextlib.suppress(StackError, httpx.HTTPError):
            admin.clear()
        admin.__exit__()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
