"""What cache-aware routing costs the gateway per request: a chat prompt of about ``--tokens``
tokens serialised and cut into chained blocks (``gateway.prefixcache``), looked up in each of
``--replicas`` replicas' models, and learned for one of them, against the baseline every policy
pays anyway: the same prompt serialised (``prompt_bytes``) with nothing cut or looked up. Also
what the engines' own reports add (``PrefixCaches.correct``, ``cachereport``): per request, each
replica's latest report checked (applied already: the common case), and, once per report (about a
second per replica, never per request), one report applied: vLLM's held blocks trimming a model of
``--tokens`` tokens, llama.cpp's 4 slots correcting a per-slot model.

Run from the repository root::

    .venv/bin/python bench/prefixcache.py                    # 2,000 tokens, 3 replicas
    .venv/bin/python bench/prefixcache.py --tokens 16000 --replicas 8

Figures are CPU time (``time.process_time``) per request, each the best of ``--rounds`` rounds
of ``--requests`` requests (the least disturbed by a shared machine); it asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

from fleetserve.cachereport import CacheReport, SlotState
from fleetserve.gateway.prefixcache import BYTES_PER_TOKEN, PrefixCaches, block_keys, prompt_bytes


def per_request(work: Callable[[], object], requests: int, rounds: int) -> float:
    """The best round's CPU seconds per call of ``work``."""
    best = float("inf")
    for _ in range(rounds):
        began = time.process_time()
        for _ in range(requests):
            work()
        best = min(best, (time.process_time() - began) / requests)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000, help="the prompt's length in tokens (2000)")
    parser.add_argument("--replicas", type=int, default=3, help="replicas looked up per request (3)")
    parser.add_argument("--requests", type=int, default=2000, help="requests a round (2000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the best is printed (5)")
    args = parser.parse_args()
    body = {
        "messages": [
            {"role": "system", "content": "w" * (args.tokens * BYTES_PER_TOKEN - 50)},
            {"role": "user", "content": "hi"},
        ]
    }
    names = [f"r{i}" for i in range(args.replicas)]
    caches = PrefixCaches()
    keys = block_keys(prompt_bytes(body))
    for name in names:
        caches.learn(name, keys)

    def serialise() -> object:
        return prompt_bytes(body)

    def cache_aware() -> object:
        cut = block_keys(prompt_bytes(body))
        for name in names:
            caches.cached_tokens(name, cut)
        caches.learn(names[0], cut)
        return cut

    reports = {name: CacheReport(seq=1, held_tokens=1 << 30) for name in names}

    def checked() -> object:
        for name in names:
            caches.correct(name, reports[name])
        return None

    seqs = itertools.count(2)
    held = len(keys) * 16

    def vllm_report() -> object:
        # The engine holds all but one block: one trimmed, then learned back for the next round.
        caches.correct(names[0], CacheReport(seq=next(seqs), held_tokens=held - 16))
        caches.learn(names[0], keys)
        return None

    slotted = PrefixCaches()
    slotted.sync("s", 4096, 0, 4)
    slotted.learn("s", keys)

    def slots_report() -> object:
        n = next(seqs)
        slots = tuple(
            SlotState(id=i, n_ctx=4096, processing=False, task=n * 4 + i, tokens=100) for i in range(4)
        )
        slotted.correct("s", CacheReport(seq=n, capacity_tokens=4096, slots=slots))
        return None

    base = per_request(serialise, args.requests, args.rounds)
    full = per_request(cache_aware, args.requests, args.rounds)
    checks = per_request(checked, args.requests * 10, args.rounds)
    print(
        f"prompt: {args.tokens} tokens, {len(keys)} blocks; {args.replicas} replicas looked up, one learned"
    )
    print(f"{'work per request':<40} {'CPU us':>8} {'CPU-s per 1,000':>16}")
    rows = (
        ("serialise only (baseline)", base),
        ("cut + look up + learn (cache-aware)", full),
        ("each replica's report checked, alone", checks),
    )
    for label, cost in rows:
        print(f"{label:<40} {cost * 1e6:>8.1f} {cost * 1e3:>16.3f}")
    print(f"{'cache-aware over the baseline':<40} {(full - base) * 1e6:>8.1f} {(full - base) * 1e3:>16.3f}")
    print(f"{'work per engine report (not per request)':<40} {'CPU us':>8}")
    vllm = per_request(vllm_report, args.requests, args.rounds)
    slots = per_request(slots_report, args.requests, args.rounds)
    print(f"{'vLLM held blocks: trim + learn again':<40} {vllm * 1e6:>8.1f}")
    print(f"{'llama.cpp 4 slots applied':<40} {slots * 1e6:>8.1f}")


if __name__ == "__main__":
    main()
