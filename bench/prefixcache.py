"""What cache-aware routing costs the gateway per request: a chat prompt of about ``--tokens``
tokens serialised and cut into chained blocks (``gateway.prefixcache``), looked up in each of
``--replicas`` replicas' models, and learned for one of them, against the baseline every policy
pays anyway: the same prompt serialised (``prompt_bytes``) with nothing cut or looked up.

Run from the repository root::

    .venv/bin/python bench/prefixcache.py                    # 2,000 tokens, 3 replicas
    .venv/bin/python bench/prefixcache.py --tokens 16000 --replicas 8

Figures are CPU time (``time.process_time``) per request, each the best of ``--rounds`` rounds
of ``--requests`` requests (the least disturbed by a shared machine); it asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

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

    base = per_request(serialise, args.requests, args.rounds)
    full = per_request(cache_aware, args.requests, args.rounds)
    print(
        f"prompt: {args.tokens} tokens, {len(keys)} blocks; {args.replicas} replicas looked up, one learned"
    )
    print(f"{'work per request':<40} {'CPU us':>8} {'CPU-s per 1,000':>16}")
    for label, cost in (("serialise only (baseline)", base), ("cut + look up + learn (cache-aware)", full)):
        print(f"{label:<40} {cost * 1e6:>8.1f} {cost * 1e3:>16.3f}")
    print(f"{'cache-aware over the baseline':<40} {(full - base) * 1e6:>8.1f} {(full - base) * 1e3:>16.3f}")


if __name__ == "__main__":
    main()
