"""A scrape fetcher on httpx: one shared ``httpx.AsyncClient`` over a small pool per origin.

The scraper's first fetcher, kept beside the default (``metrics.fetch.HttpFetcher``, a fraction
of its CPU per scrape) so that ``bench/scrape.py`` can compare the two. It raises the same
``ScrapeError`` hierarchy.
"""

from __future__ import annotations

from collections import OrderedDict

import httpx

from fleetserve.metrics.fetch import (
    DEFAULT_MAX_ORIGINS,
    MAX_BODY_BYTES,
    BadStatus,
    FetchFailed,
    ScrapeTimeout,
    body_error,
)


class OriginPoolTransport(httpx.AsyncBaseTransport):
    """An httpx transport with one small connection pool per origin, least recently used evicted.

    httpcore's pool scans every pooled connection on each request and each response close (and
    polls each idle socket), so one pool over a thousand origins costs O(origins) per request;
    here each origin's pool holds a connection or two. Idle sockets stay bounded at
    ``max_origins * per_origin``.
    """

    def __init__(self, *, max_origins: int = DEFAULT_MAX_ORIGINS, per_origin: int = 2) -> None:
        self._max_origins = max_origins
        self._limits = httpx.Limits(max_connections=per_origin, max_keepalive_connections=per_origin)
        # One TLS context for every origin: building one per pool would load the CA bundle each time.
        self._ssl = httpx.create_ssl_context()
        self._pools: OrderedDict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = OrderedDict()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(origin)
        if pool is None:
            pool = httpx.AsyncHTTPTransport(verify=self._ssl, limits=self._limits, trust_env=False)
            self._pools[origin] = pool
            if len(self._pools) > self._max_origins:
                _, evicted = self._pools.popitem(last=False)
                await evicted.aclose()
        else:
            self._pools.move_to_end(origin)
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), OrderedDict()
        for pool in pools:
            await pool.aclose()


class HttpxFetcher:
    """A fetcher on one shared ``httpx.AsyncClient``, keep-alive, a small pool per origin."""

    def __init__(
        self,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_origins: int = DEFAULT_MAX_ORIGINS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self._client = httpx.AsyncClient(
            transport=transport if transport is not None else OriginPoolTransport(max_origins=max_origins),
            # Compressing 3 KB on loopback or a LAN costs both sides more CPU than it saves.
            headers={"Accept-Encoding": "identity", "Accept": "text/plain"},
            follow_redirects=False,
            trust_env=False,
        )

    async def __call__(self, url: str, timeout: float, bearer: str | None = None) -> bytes:
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else None
        try:
            async with self._client.stream("GET", url, timeout=timeout, headers=headers) as response:
                if response.status_code != 200:
                    raise BadStatus(response.status_code)
                declared = _content_length(response)
                too_large = body_error(0, declared, self.max_body_bytes)
                if too_large is not None:
                    raise too_large
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    too_large = body_error(size, None, self.max_body_bytes)
                    if too_large is not None:
                        raise too_large
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.TimeoutException as exc:
            raise ScrapeTimeout(timeout) from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise FetchFailed(f"fetch failed: {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self._client.aclose()


def _content_length(response: httpx.Response) -> int | None:
    value = response.headers.get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


__all__ = ["HttpxFetcher", "OriginPoolTransport"]
