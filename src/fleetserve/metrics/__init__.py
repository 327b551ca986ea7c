"""Metrics: engine and GPU readings mapped to fleetserve's canonical names (design.md, Metrics).

The pure mapping layer:

- ``promtext``: Prometheus text exposition parsed into ``Sample`` values (the one sample type);
- ``mapping``: the ``MetricMapping`` value each engine's row carries (``ENGINES[kind].metrics``);
- ``engine``: configured mappings, the default-mapping rule, and ``normalize``, which turns an
  engine's ``/metrics`` into ``fleetserve_requests_running`` and the other canonical series;
  ``kv_from_slots`` for llama-server's ``/slots``;
- ``gpu``: one ``SOURCES`` row per GPU metrics source (DCGM exporter, AMD device-metrics-exporter,
  the agent's NVML and sysfs reads) and ``normalize_gpu``/``from_nvml``/``from_amd_sysfs``.

Scraping (I/O) and fleetserve's own exposition live in their own modules beside these.
"""
