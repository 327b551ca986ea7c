"""rawasgi.headers: a header by name, and the bearer token of Authorization."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fleetserve.rawasgi.headers import bearer, bearer_token, header


def scope_with(*headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"type": "http", "headers": list(headers)}


def test_a_header_is_found_by_its_lower_case_name() -> None:
    scope = scope_with((b"host", b"a"), (b"x-one", b"1"))
    assert header(scope, b"x-one") == b"1"


def test_a_missing_header_is_none() -> None:
    assert header(scope_with((b"host", b"a")), b"x-one") is None
    assert header({"type": "http"}, b"x-one") is None


def test_a_repeated_header_gives_its_first_value() -> None:
    assert header(scope_with((b"x-one", b"1"), (b"x-one", b"2")), b"x-one") == b"1"


@dataclass(frozen=True)
class Case:
    name: str
    value: bytes
    token: str | None


BEARER_CASES = [
    Case("a bearer token is its token", b"Bearer abc", "abc"),
    Case("the scheme is read in any case", b"bEaReR abc", "abc"),
    Case("the token is stripped", b"Bearer   abc  ", "abc"),
    Case("another scheme names no token", b"Basic abc", None),
    Case("an empty token names no token", b"Bearer   ", None),
    Case("a scheme alone names no token", b"Bearer", None),
    Case("an empty value names no token", b"", None),
]


@pytest.mark.parametrize("case", BEARER_CASES, ids=[c.name for c in BEARER_CASES])
def test_an_authorization_value_names_a_bearer_token_or_none(case: Case) -> None:
    assert bearer(case.value) == case.token


SCOPE_CASES = [
    ("one bearer header gives its token", [(b"authorization", b"Bearer t1")], "t1"),
    ("no authorization header gives none", [(b"host", b"a")], None),
    (
        "two authorization headers give none",
        [(b"authorization", b"Bearer t1"), (b"authorization", b"Bearer t1")],
        None,
    ),
    ("a header of another scheme gives none", [(b"authorization", b"Basic t1")], None),
]


@pytest.mark.parametrize(("headers", "token"), [c[1:] for c in SCOPE_CASES], ids=[c[0] for c in SCOPE_CASES])
def test_a_request_names_a_bearer_token_only_in_exactly_one_header(
    headers: list[tuple[bytes, bytes]], token: str | None
) -> None:
    assert bearer_token(scope_with(*headers)) == token
