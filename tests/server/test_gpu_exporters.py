"""The control plane's exporter scrape: discovery refreshed, a failed discovery keeps what was found
(said once), an exporter found anew is read at once; the exporter serves recorded DCGM output."""

from __future__ import annotations

import asyncio
import logging

import pytest

from fleetserve.drivers import Driver
from fleetserve.kube.apply import KubeError
from fleetserve.metrics.exporters import ExporterTarget
from fleetserve.server.gpu_exporters import ExporterScrape
from loopback_exporter import DCGM_L4, running_exporter


def test_a_failed_discovery_keeps_the_exporters_found_before_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with running_exporter(DCGM_L4) as dcgm:
        target = ExporterTarget(Driver.NVIDIA, "gpu-1", dcgm.url, pod="gpu-operator/dcgm-0")
        answers: list[list[ExporterTarget] | Exception] = [
            [target],
            KubeError("listing the dcgm-exporter pods: HTTP 503"),
            KubeError("listing the dcgm-exporter pods: HTTP 503"),
            [],
        ]

        def discover() -> list[ExporterTarget]:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        scrape = ExporterScrape(discover)

        async def cycles() -> list[list[str]]:
            seen = []
            for _ in range(4):
                await scrape.refresh_once()
                seen.append(sorted({labels["node"] for _, labels, _ in scrape.gpu_samples()}))
            await scrape.scraper.aclose()
            return seen

        with caplog.at_level(logging.INFO, logger="fleetserve.exporters"):
            seen = asyncio.run(cycles())
    assert seen == [["gpu-1"], ["gpu-1"], ["gpu-1"], []], "kept through the failures, gone when not found"
    assert dcgm.scrapes == 1, "found once: read at once, then at the scraper's pace"
    failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failures == [
        "finding the GPU metrics exporters failed (keeping 1): listing the dcgm-exporter pods: HTTP 503"
    ]
    assert scrape.discoveries == 2
