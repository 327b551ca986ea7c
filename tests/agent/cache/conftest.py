"""The model cache's tests: a file server that serves the tiny body at a plain path and at the
control plane's path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cache_support import BODY, CONTROL_PATH, FileServer


@pytest.fixture
def server() -> Iterator[FileServer]:
    fs = FileServer()
    fs.files["/models/tiny.gguf"] = BODY
    fs.files[CONTROL_PATH] = BODY
    try:
        yield fs
    finally:
        fs.close()
