"""The tests of llama.cpp's ``tools/server/tests`` the peer suite does not run, each with why.

Two kinds: tests that need a model this machine and CI do not have, and tests of an engine route
fleetserve never relays by design (``CORS_PROXY``).

The suite runs on one model: the project's tiny GGUF, served by a loopback Hub as
``ggml-org/models``/``tinyllamas/stories260K.gguf`` and ``ggml-org/test-model-stories260K`` (what
``ServerProcess`` and the ``tinyllama2`` preset ask for). A test that needs any other model from the
Hub cannot run here (CI reaches PyPI, not the Hub) and is left out, by file or by test function
(every parametrization). Besides these, the suite's own ``slow`` marker is deselected, as its
``tests.sh`` does without ``SLOW_TESTS=1``: those tests download big models (``SLOW_MARKED``).
"""

from __future__ import annotations

ROUTER = (
    "llama-server's router mode (the router preset: no model of its own; it loads Hub models such "
    "as ggml-org/tinygemma3-GGUF on demand): no single model to deploy, and the models are not here"
)

EXCLUDED_FILES: dict[str, str] = {
    "unit/test_embedding.py": "needs ggml-org/models bert-bge-small (an embedding model)",
    "unit/test_rerank.py": "needs ggml-org/models jina-reranker-v1-tiny-en (a reranking model)",
    "unit/test_infill.py": (
        "needs ggml-org/test-model-stories260K-infill (a model with fill-in-the-middle tokens) or "
        "ggml-org/Qwen2.5-Coder-1.5B-IQ3_XXS-GGUF"
    ),
    "unit/test_lora.py": "needs ggml-org/stories15M_MOE and LoRA adapters downloaded from the Hub",
    "unit/test_speculative.py": "needs ggml-org/stories15M_MOE and a draft model",
    "unit/test_systemone.py": "needs ggml-org/tinylaya-for-testing-gguf and tinyopenjev-for-testing-gguf",
    "unit/test_vision_api.py": "needs ggml-org/tinygemma3-GGUF and its mmproj (vision)",
    "unit/test_router.py": ROUTER,
    "unit/test_mcp_servers.py": ROUTER,
    "unit/test_tools_builtin.py": ROUTER,
    "unit/test_stream.py": ROUTER,
}

TINYGEMMA = "needs ggml-org/tinygemma3-GGUF and its mmproj (images)"
CORS_PROXY = (
    "llama-server's CORS proxy for its web UI (--ui-mcp-proxy, /cors-proxy): by design never "
    "relayed to API keys (issue 31, item 1), and the engine row does not allow the flag"
)

EXCLUDED_TESTS: dict[str, str] = {
    "unit/test_basic.py::test_load_split_model": "needs ggml-org/models tinyllamas/split/stories15M (split GGUF)",
    "unit/test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model": TINYGEMMA,
    "unit/test_metrics.py::test_metrics_embedding_prompt_is_counted": "needs ggml-org/models bert-bge-small",
    "unit/test_security.py::test_cors_origins_localhost_reflects": ROUTER,
    "unit/test_security.py::test_cors_origins_localhost_rejects": ROUTER,
    "unit/test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled": ROUTER,
    "unit/test_security.py::test_local_media_file": TINYGEMMA,
    "unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers": CORS_PROXY,
    "unit/test_proxy.py::test_mcp_proxy": CORS_PROXY,
    "unit/test_proxy.py::test_mcp_proxy_custom_port": CORS_PROXY,
    "unit/test_proxy.py::test_mcp_proxy_no_content": CORS_PROXY,
    "unit/test_slot_save.py::test_slot_save_restore_text_only_on_multimodal": TINYGEMMA,
    "unit/test_slot_save.py::test_slot_save_restore_with_image": TINYGEMMA,
    "unit/test_slot_save.py::test_slot_save_restore_with_two_images": TINYGEMMA,
    "unit/test_slot_save.py::test_slot_save_restore_with_image_across_restart": TINYGEMMA,
    "unit/test_slot_save.py::test_slot_save_restore_image_payload_larger_than_context": TINYGEMMA,
    "unit/test_slot_save.py::test_slot_restore_media_file_without_mmproj": TINYGEMMA,
}

SLOW_MARKED = (
    "the suite's own slow marker (deselected as its tests.sh does without SLOW_TESTS=1): real "
    "models such as Phi-3.5-mini, DeepSeek-R1-Distill-Qwen-7B and the tool-calling models"
)


def excluded(nodeid: str) -> str | None:
    """Why the test ``nodeid`` (``unit/test_x.py::test_name[params]``) is left out, or None."""
    path, _, rest = nodeid.partition("::")
    if path in EXCLUDED_FILES:
        return EXCLUDED_FILES[path]
    return EXCLUDED_TESTS.get(f"{path}::{rest.partition('[')[0]}")
