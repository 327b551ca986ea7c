"""The admin API's Endpoints (servers fleetserve did not start): each answered as its document
with the control plane's last health check. The document names its key file, never the key: no
answer of the admin API holds an Endpoint's key."""

from __future__ import annotations

from fleetserve.adminapi.values import IsoTime, View
from fleetserve.spec.endpoint import Endpoint, EndpointState


class EndpointHealthView(View):
    """The control plane's last health check of an Endpoint: its state, what failed, and when."""

    state: EndpointState
    last_error: str | None = None
    checked_at: IsoTime | None = None


class EndpointView(Endpoint):
    """An Endpoint: its document and its health."""

    status: EndpointHealthView
