"""What each engine row says of its cache's state: vLLM is told to publish KV events to the
agent's loopback endpoint (``--kv-events-config``, only when the agent gives one, and never from
engineArgs); llama.cpp's ``/slots`` answer read into slots, bounded, and refused when it is not
one (the live answers: tests/e2e/test_slots_correction_live.py, tests/e2e/test_vllm_kv_events.py)."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from fleetserve.cachereport import MAX_SLOTS, SlotState
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.launch import LaunchContext
from fleetserve.engines.llamacpp import read_slots
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.spec.resources import Profile, Replica, Shard


def vllm_argv(variant: RuntimeVariant, endpoint: str | None) -> tuple[str, ...]:
    on_cpu = variant is RuntimeVariant.CPU
    replica = Replica(
        name="d-0",
        deployment="d",
        profile="p",
        device_class=None if on_cpu else "gpu",
        shards=(Shard(node="n", devices=() if on_cpu else (0,), cpu_cores=1, memory=1 << 30),),
    )
    ctx = LaunchContext(
        replica=replica,
        shard_index=0,
        profile=Profile(
            name="p", engine=EngineKind.VLLM, runtime=variant, device_class=None if on_cpu else "gpu"
        ),
        variant=variant,
        driver=ENGINES[EngineKind.VLLM].variants[variant],
        model_path=Path("/models/m"),
        binary="/opt/bin/vllm",
        host="127.0.0.1",
        port=18000,
        context=None,
        kv_events_endpoint=endpoint,
    )
    return ENGINES[EngineKind.VLLM].adapter.launch(ctx).argv


@pytest.mark.parametrize("variant", list(ENGINES[EngineKind.VLLM].variants))
def test_vllm_publishes_its_kv_events_to_the_agents_loopback_endpoint(variant):
    args = vllm_argv(variant, "tcp://127.0.0.1:41234")
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:41234",
        "topic": ENGINES[EngineKind.VLLM].kv_events.topic,  # type: ignore[union-attr]
    }
    assert "--kv-events-config" not in vllm_argv(variant, None)


def test_no_profile_can_set_the_events_config_itself():
    """A profile's --kv-events-config could bind the unauthenticated socket on the node's network."""
    for engine in ENGINES.values():
        assert "--kv-events-config" not in engine.allowed_args


def test_which_rows_say_what():
    assert ENGINES[EngineKind.VLLM].kv_events is not None and ENGINES[EngineKind.VLLM].cache_state is None
    llama = ENGINES[EngineKind.LLAMACPP]
    assert llama.kv_events is None and llama.cache_state is not None and llama.cache_state.path == "/slots"
    assert Driver.CPU in llama.drivers()


# b11434's answer for two slots, one having served a task (trimmed params).
SLOTS = [
    {
        "id": 0, "n_ctx": 4096, "speculative": False, "is_processing": False, "id_task": 57,
        "n_prompt_tokens": 1203, "n_prompt_tokens_processed": 12, "n_prompt_tokens_cache": 1191,
        "params": {"n_predict": 2}, "next_token": [{"has_next_token": False, "n_decoded": 2}],
    },
    {"id": 1, "n_ctx": 4096, "speculative": False, "is_processing": True},
]  # fmt: skip


def test_llama_slots_are_read():
    assert read_slots(orjson.dumps(SLOTS)) == (
        SlotState(id=0, n_ctx=4096, processing=False, task=57, tokens=1203),
        SlotState(id=1, n_ctx=4096, processing=True, task=None, tokens=0),
    )
    assert read_slots(b"[]") == ()


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"error": {"message": "This server does not support slots endpoint."}}', b"[1]",
     b'[{"id": 0}]', b'[{"id": -1, "n_ctx": 5}]', b'[{"id": true, "n_ctx": 5}]'],
)  # fmt: skip
def test_an_answer_that_is_not_slots_is_refused(body):
    assert read_slots(body) is None


def test_at_most_max_slots_are_read():
    many = [{"id": i, "n_ctx": 64, "is_processing": False} for i in range(MAX_SLOTS + 10)]
    read = read_slots(orjson.dumps(many))
    assert read is not None and len(read) == MAX_SLOTS
