"""Metrics: engine and GPU readings mapped to fleetserve's canonical names (design.md, Metrics).

The pure mapping layer:

- ``promtext``: Prometheus text exposition parsed into ``Sample`` values (the one sample type);
- ``mapping``: the ``MetricMapping`` value each engine's row carries (``ENGINES[kind].metrics``);
- ``engine``: configured mappings, the default-mapping rule, and ``normalize``, which turns an
  engine's ``/metrics`` into ``fleetserve_requests_running`` and the other canonical series;
  ``kv_from_slots`` for llama-server's ``/slots``;
- ``gpu``: one ``SOURCES`` row per GPU metrics source (DCGM exporter, AMD device-metrics-exporter,
  the agent's NVML and sysfs reads) and ``normalize_gpu``/``from_nvml``/``from_amd_sysfs``.

Scraping (the I/O), beside these:

- ``targets``: a scrape ``Target``, the ``Scrape`` a reader sees, and the pure freshness rules
  (``view``, ``staleness``, ``next_tick``);
- ``fetch``: the ``Fetcher`` seam, the ``ScrapeError`` hierarchy, and the default ``HttpFetcher``
  (lean HTTP/1.1 over ``fleetserve.httpclient``); ``httpxfetch``: one on httpx, for comparison;
- ``scraper``: the ``Scraper`` (every target once per interval, the last raw body kept) and its
  self-metrics (``ScraperCollector``).

fleetserve's own ``/metrics`` is ``exposition``.
"""
