"""The OpenAI-compatible gateway: endpoint picking, rate limits, admission and the HTTP proxy.

The data path, a request in the order it meets the modules:

- ``asgi``: ``/v1`` as raw ASGI (``rawasgi``), dispatched by exact path before FastAPI
  (``OpenAIApi``), and the app that puts it in front (``ServingApp``).
- ``cors``: for the configured origins only, a browser's preflight answered and the CORS headers
  every answer to them gets, computed once.
- ``app``: the proxy, ``Gateway``: API keys, the checks, admission, forwarding with one retry,
  streaming; its state (routes, windows, in-flight counts, the upstream client).
- ``openai_errors``: its refusals in OpenAI's error shape, and the event that ends a broken stream.
- ``upstream``: the request sent to an engine (origin, head with the engine key, body), the
  answer headers relayed back (hop-by-hop ones dropped), a streamed answer relayed as it comes.
- ``accounting``: the tokens a request reserves before its usage is known, one request's
  ``Exchange``, and ``Accounting``, which counts every answer into usage and metrics.

What the proxy asks:

- ``endpoints``: the routes (model → Ready replicas), refreshed from the store; outlier ejection.
- ``picker``: which replica, by the deployment's ``routing.policy``: cache-aware (expected cached
  prefix against load, with a balance guard), least load, prefix hash, round robin.
- ``prefixcache``: what this gateway believes each replica caches, in blocks of the prompt, from
  what it routed; cleared when a replica's engine restarted.
- ``admission``: concurrency per replica, the FIFO queue, the hold for a replica to come up.
- ``ratelimit``, ``windows``: per-key requests and tokens per minute, in memory or in Redis.
- ``sse``: the usage event of a stream (asked for, counted, stripped) and of a whole body.
- ``usage``, ``usage_flush``: usage per minute, key and model in memory, written every few seconds.
"""
