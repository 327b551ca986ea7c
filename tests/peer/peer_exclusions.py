"""The tests of llama.cpp's ``tools/server/tests`` the peer suite does not run, each with why.

Two kinds: tests that need a model this machine and CI do not have, and tests of what fleetserve
does differently on purpose (``CORS_PROXY``, ``DELIBERATE``: /slots and engine state never relayed
to keys, fleetserve's own slot count, /metrics and CORS, the listener the operator's), each with
the rule it meets.

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

# What fleetserve does differently on purpose: a test of it fails through the gateway by design.
SLOTS = (
    "reads or acts on the engine's /slots, which the gateway never relays to API keys (issue 31, "
    "item 1: other requests' state, and actions that change the engine's)"
)
SLOT_COUNT = (
    "expects the slot count the test asks for (--parallel): fleetserve sets an engine's slots from "
    "its engine row, which the gateway's admission counts on (engines/llamacpp.py)"
)
ENGINE_METRICS = (
    "reads llama-server's own /metrics: behind fleetserve /metrics is the control plane's, every "
    "engine's metrics mapped onto one surface (design.md, Metrics); engines' /metrics are not "
    "relayed to API keys"
)
DELIBERATE: dict[str, str] = {
    "unit/test_basic.py::test_server_multiple_addresses": (
        "asks llama-server to listen on two addresses (127.0.0.1,::1): a gateway's listener is the "
        "operator's (fleetserve gateway --host), not a deployment's"
    ),
    "unit/test_basic.py::test_server_props": SLOT_COUNT,
    "unit/test_basic.py::test_server_slots": SLOTS,
    "unit/test_basic.py::test_server_model_aliases_and_tags": (
        "expects llama-server's --alias list as the model's names (id 'code'): a deployment is "
        "served under its own name; other names reach only the fleet's default deployment "
        "(routing.default)"
    ),
    "unit/test_completion.py::test_cancel_request": SLOTS,
    "unit/test_metrics.py::test_metrics_disabled": ENGINE_METRICS,
    "unit/test_metrics.py::test_metrics_prometheus_format": ENGINE_METRICS,
    "unit/test_metrics.py::test_metrics_prompt_processed_and_cached": ENGINE_METRICS,
    "unit/test_metrics.py::test_metrics_predicted_total_matches_requests": ENGINE_METRICS,
    "unit/test_metrics.py::test_metrics_slots_idle_after_completion": SLOTS,
    "unit/test_sleep.py::test_server_sleep_read_only_endpoints": ENGINE_METRICS,
    "unit/test_sleep.py::test_server_sleep_metrics_buckets": ENGINE_METRICS,
    "unit/test_security.py::test_cors_options": (
        "expects llama-server's CORS (any origin, credentials allowed, every header): fleetserve "
        "answers preflights only for the operator's --cors-origin origins and never allows "
        "credentials (gateway/cors.py)"
    ),
    "unit/test_compat_gcp.py::test_gcp_predict_camel_case": (
        "Vertex AI prediction mode (/predict) is switched on by the engine process's environment "
        "(AIP_MODE), which no deployment sets"
    ),
    "unit/test_compat_gcp.py::test_gcp_predict_multiple_instances": (
        "Vertex AI prediction mode (/predict) is switched on by the engine process's environment "
        "(AIP_MODE), which no deployment sets"
    ),
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
    test = f"{path}::{rest.partition('[')[0]}"
    return EXCLUDED_TESTS.get(test) or DELIBERATE.get(test)
