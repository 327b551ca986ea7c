"""One loopback HTTP server on a thread of its own, for the test suite's stand-ins (a recorded GPU
exporter, the Kubernetes API server): started on ``127.0.0.1``, stopped and its socket closed on
exit, whatever the test did."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serving_on_loopback(handler: type[BaseHTTPRequestHandler], name: str, port: int = 0) -> Iterator[int]:
    """Serve ``handler`` on 127.0.0.1 (a free port unless ``port``); yields the port."""
    httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, name=name, daemon=True
    )
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
