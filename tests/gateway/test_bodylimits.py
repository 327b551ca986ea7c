"""What a /v1 body may hold (``gateway.bodylimits``): size, nesting, keys per object and in all,
per kind of route, each refusal naming its limit and the flag; and the flag's parsing."""

from __future__ import annotations

import time

import orjson
import pytest

from fleetserve.engines.routes import RouteKind
from fleetserve.gateway.bodylimits import (
    DEFAULT_BODY_LIMITS,
    DEFAULT_GATEWAY_LIMITS,
    BodyKind,
    BodyLimits,
    body_limits,
    exceeded,
    kind_of,
)

SMALL = BodyLimits(bytes=1000, depth=3, keys=4, total_keys=10)


def check(value: object, size: int = 10) -> tuple[int, str] | None:
    got = exceeded(value, size, BodyKind.GENERATION, SMALL)
    return None if got is None else (got.status, got.message)


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        ({"a": {"b": {"c": {}}}}, "depth"),  # 4 levels of 3
        ([[[[1]]]], "depth"),
        ({"a": [{"b": [1]}]}, "depth"),
        ({str(i): i for i in range(5)}, "keys"),
        ([{str(i): i for i in range(4)}] * 3, "total_keys"),  # 12 keys in all, 10 allowed
    ],
)
def test_a_body_past_a_limit_is_400_naming_the_limit_and_its_flag(value: object, limit: str) -> None:
    got = check(value)
    assert got is not None
    status, message = got
    assert status == 400
    assert f"--body-limit generation.{limit}=N" in message


@pytest.mark.parametrize(
    "value",
    [
        {"a": {"b": {"c": 1}}},  # 3 levels: at the limit
        {str(i): [1, 2, 3] for i in range(4)},
        [{"a": 1}, {"b": 2}, {"c": 3}],
        "just a string",
        [1] * 100_000,  # arrays of scalars are not counted
        None,
    ],
)
def test_a_body_within_its_limits_passes(value: object) -> None:
    assert check(value) is None


def test_a_body_larger_than_its_bytes_is_413() -> None:
    got = check({}, size=1001)
    assert got is not None and got[0] == 413 and "generation.bytes" in got[1]


def test_the_80k_key_body_of_the_issue_is_refused_at_once_by_the_defaults() -> None:
    body = orjson.dumps({"model": "m", "prompt": "x", "logit_bias": {str(i): 0 for i in range(80_000)}})
    data = orjson.loads(body)
    started = time.process_time()
    got = DEFAULT_GATEWAY_LIMITS.check(data, len(body), RouteKind.GENERATION)
    assert got is not None and got.status == 400 and "generation.keys" in got.message
    assert time.process_time() - started < 1.0  # one len() of the object, not a walk of its keys


def test_many_objects_just_under_the_per_object_limit_hit_the_total() -> None:
    data = {"model": "m", "messages": [{f"k{j}": 1 for j in range(1000)} for _ in range(70)]}
    got = DEFAULT_GATEWAY_LIMITS.check(data, 10, RouteKind.GENERATION)
    assert got is not None and "generation.total_keys" in got.message


def test_embeddings_and_rerank_have_their_own_limits() -> None:
    assert kind_of(RouteKind.EMBEDDINGS) is BodyKind.EMBEDDINGS
    assert kind_of(RouteKind.RERANK) is BodyKind.EMBEDDINGS
    assert kind_of(RouteKind.GENERATION) is BodyKind.GENERATION
    assert kind_of(RouteKind.TOKENIZATION) is BodyKind.GENERATION
    deep = {"input": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}  # 19 levels: over embeddings' 16
    assert DEFAULT_GATEWAY_LIMITS.check(deep, 10, RouteKind.GENERATION) is None
    refused = DEFAULT_GATEWAY_LIMITS.check(deep, 10, RouteKind.EMBEDDINGS)
    assert refused is not None and "embeddings.depth" in refused.message


def test_body_limit_settings_override_one_limit_of_one_kind() -> None:
    table = body_limits(["generation.keys=4096", "embeddings.bytes=16MiB"])
    assert table[BodyKind.GENERATION].keys == 4096
    assert table[BodyKind.GENERATION].bytes == DEFAULT_BODY_LIMITS[BodyKind.GENERATION].bytes
    assert table[BodyKind.EMBEDDINGS].bytes == 16 << 20
    assert DEFAULT_BODY_LIMITS[BodyKind.GENERATION].keys == 1024  # the defaults are not changed


@pytest.mark.parametrize(
    "setting",
    [
        "keys=5",
        "chat.keys=5",
        "generation.colour=5",
        "generation.keys",
        "generation.keys=0",
        "generation.bytes=1GiB",
    ],
)
def test_a_bad_body_limit_setting_is_refused_saying_how_to_write_one(setting: str) -> None:
    with pytest.raises(ValueError):
        body_limits([setting])


def test_a_million_empty_objects_are_refused_without_walking_them() -> None:
    body = b"[" + b"{}," * 1_000_000 + b"{}]"
    got = DEFAULT_GATEWAY_LIMITS.check(orjson.loads(body), len(body), RouteKind.GENERATION)
    assert got is not None and "generation.total_keys" in got.message


def test_large_arrays_of_numbers_and_many_inputs_pass() -> None:
    inputs = {"model": "m", "input": [[1] * 1000] * 2048}  # 2,048 token arrays
    assert DEFAULT_GATEWAY_LIMITS.check(inputs, 10, RouteKind.EMBEDDINGS) is None
    assert (
        DEFAULT_GATEWAY_LIMITS.check({"model": "m", "prompt": [7] * 1_000_000}, 10, RouteKind.GENERATION)
        is None
    )
