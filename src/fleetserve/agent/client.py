"""The agent's side of the agents' API (its bodies: ``fleetserve.protocol``): register, heartbeat,
assignments, status, classes."""

from __future__ import annotations

import ssl
from typing import Any

import httpx

from fleetserve.errors import FleetserveError, StaleEpoch
from fleetserve.protocol import AssignmentSet, HeartbeatRequest, Registered, StatusReply, StatusReport
from fleetserve.spec.resources import DeviceClass, Node

API = "/api/v1/agent"


class AgentApiError(FleetserveError):
    """The control plane could not be reached or refused the agent."""


class AgentClient:
    """HTTP client of the agents' API, authenticated with the join token; ``verify`` is how it
    verifies the server's certificate (``fleetserve.tls.client_verify``)."""

    def __init__(
        self,
        server: str,
        token: str,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self._http = httpx.Client(
            base_url=self.server,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(10.0, read=45.0),
            transport=transport,
            verify=verify,
        )

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, API + path, **kwargs)
        except httpx.HTTPError as exc:
            raise AgentApiError(f"cannot reach the control plane at {self.server}: {exc}") from exc
        if response.status_code == 409:
            raise StaleEpoch(response.json().get("error", {}).get("message", "stale epoch"))
        if response.status_code >= 400:
            try:
                message = response.json().get("error", {}).get("message") or response.text
            except ValueError:
                message = response.text
            hint = " (is the join token right?)" if response.status_code == 401 else ""
            raise AgentApiError(f"{method} {path}: {response.status_code} {message}{hint}")
        return response.json()

    def classes(self) -> list[DeviceClass]:
        """The device classes, to match discovered devices against."""
        return [DeviceClass.model_validate(c) for c in self._call("GET", "/classes")]

    def register(self, node: Node) -> tuple[Node, AssignmentSet]:
        """Register (or re-register) the node; its epoch and current assignments."""
        data = self._call("POST", "/register", json=node.model_dump(mode="json", by_alias=True))
        registered = Registered.model_validate(data)
        return registered.node, AssignmentSet(
            epoch=registered.epoch, revision=registered.revision, assignments=registered.assignments
        )

    def heartbeat(self, node: str, epoch: int) -> None:
        """Say the node is alive; StaleEpoch if it registered again since."""
        body = HeartbeatRequest(node=node, epoch=epoch)
        self._call("POST", "/heartbeat", json=body.model_dump(mode="json"))

    def assignments(self, node: str, epoch: int, since: str | None, wait: float) -> AssignmentSet:
        """The node's assignments, held open up to ``wait`` seconds until they differ from ``since``."""
        params: dict[str, Any] = {"node": node, "epoch": epoch, "wait": wait}
        if since:
            params["since"] = since
        return AssignmentSet.model_validate(self._call("GET", "/assignments", params=params))

    def status(self, report: StatusReport) -> list[str]:
        """Send a status report; the names of replicas the agent must stop."""
        body = report.model_dump(mode="json", by_alias=True, exclude_unset=True)
        return StatusReply.model_validate(self._call("POST", "/status", json=body)).stop

    def model_file_url(self, name: str) -> str:
        """Where the server serves a model file it holds."""
        return f"{self.server}{API}/models/{name}/file"
