"""A GPU metrics exporter on loopback that serves RECORDED exporter output, byte for byte.

No GPU, no DCGM and no AMD exporter can run on this machine. What this serves at ``/metrics`` is a
scrape body from ``tests/fixtures/metrics`` — output that NVIDIA's DCGM exporter and AMD's
device-metrics-exporter wrote on real devices (an NVIDIA L4, an AMD MI300X OAM and others),
published where ``tests/fixtures/metrics/README.md`` says — so fleetserve's discovery, scraper and
relay are exercised over real HTTP against what real exporters send. Nothing here makes up a value.

Run it as a process too: ``python tests/loopback_exporter.py FIXTURE.prom [--port N]`` prints the
URL on stdout and serves until killed.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from loopback_http import serving_on_loopback

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "metrics"
# Published scrapes of real devices (tests/fixtures/metrics/README.md says where from).
DCGM_L4 = FIXTURES / "dcgm_exporter_nvidia_l4.prom"
AMD_MI300X = FIXTURES / "amd_exporter_mi300x_pr236_excerpt.prom"
AMD_24GB = FIXTURES / "amd_exporter_issue259_excerpt.prom"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class LoopbackExporter:
    """The exporter's state: what it serves, where, and how many scrapes it answered."""

    body: bytes
    port: int = 0
    scrapes: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"


def _handler(state: LoopbackExporter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: each answer closes its connection, so a stopped exporter answers no one.
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            state.scrapes += 1
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(state.body)))
            self.end_headers()
            self.wfile.write(state.body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def running_exporter(recorded: Path, port: int = 0) -> Iterator[LoopbackExporter]:
    """Serve ``recorded`` at ``http://127.0.0.1:PORT/metrics`` (a free port unless ``port``)."""
    state = LoopbackExporter(recorded.read_bytes())
    with serving_on_loopback(_handler(state), "loopback-exporter", port) as state.port:
        yield state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recorded", type=Path, help="a recorded exporter scrape (tests/fixtures/metrics)")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with running_exporter(args.recorded, args.port) as exporter:
        print(exporter.url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
