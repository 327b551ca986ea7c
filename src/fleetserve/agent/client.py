"""The agent's side of the agents' API (its bodies: ``fleetserve.protocol``): enrol or register,
heartbeat, assignments, status, classes.

The join token is used to enrol only: the answer carries the node's credential, which the client
keeps (``CredentialFile``) and sends on every later call. A restarted agent registers with its
stored credential; if the server no longer knows it (the node was deleted), it enrols again.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import httpx

from fleetserve.agent.credential import CredentialFile
from fleetserve.errors import FleetserveError, StaleEpoch
from fleetserve.protocol import AssignmentSet, HeartbeatRequest, Registered, StatusReply, StatusReport
from fleetserve.spec.resources import DeviceClass, Node

API = "/api/v1/agent"
log = logging.getLogger("fleetserve.agent")

# Error types the server answers when an enrolment waits for an operator (server/agents/routes.py).
PENDING = frozenset({"name_taken", "approval_required"})


class AgentApiError(FleetserveError):
    """The control plane could not be reached or refused the agent."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EnrolmentPending(AgentApiError):
    """The enrolment waits for an operator's approval: the name is enrolled already, or the
    server approves new names by hand. The message says which, and the command that approves."""


class AgentClient:
    """HTTP client of the agents' API: the join token to enrol, the node's credential after;
    ``verify`` is how it verifies the server's certificate (``fleetserve.tls.client_verify``)."""

    def __init__(
        self,
        server: str,
        join_token: str | None,
        credentials: CredentialFile | None = None,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
        report_timeout: float = 10.0,
    ) -> None:
        self.server = server.rstrip("/")
        self.join_token = join_token
        self.credentials = credentials
        self.credential: str | None = None
        # A status report is the heartbeat: one that hangs (a link that dropped packets) must give
        # way to the next one soon, so the agent notices a healed link (and is fenced) quickly.
        self.report_timeout = report_timeout
        self._http = httpx.Client(
            base_url=self.server,
            timeout=httpx.Timeout(10.0, read=45.0),
            transport=transport,
            verify=verify,
        )

    def close(self) -> None:
        self._http.close()

    def token(self) -> str:
        """What the agent authenticates with now: its credential once it has one."""
        return self.credential or self.join_token or ""

    def _call(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {token or self.token()}"}
        try:
            response = self._http.request(method, API + path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise AgentApiError(f"cannot reach the control plane at {self.server}: {exc}") from exc
        if response.status_code < 400:
            return response.json()
        try:
            error = response.json().get("error", {})
        except ValueError:
            error = {}
        message = error.get("message") or response.text
        if error.get("type") == "stale_epoch":
            raise StaleEpoch(message)
        if error.get("type") in PENDING:
            raise EnrolmentPending(message, response.status_code)
        hint = " (is the join token or the node's credential right?)" if response.status_code == 401 else ""
        raise AgentApiError(f"{method} {path}: {response.status_code} {message}{hint}", response.status_code)

    def classes(self) -> list[DeviceClass]:
        """The device classes, to match discovered devices against."""
        return [DeviceClass.model_validate(c) for c in self._call("GET", "/classes")]

    def register(self, node: Node) -> tuple[Node, AssignmentSet]:
        """Register the node with its stored credential, or enrol it with the join token (and keep
        the credential the answer carries); its epoch and current assignments. EnrolmentPending
        while an operator's approval is needed."""
        body = node.model_dump(mode="json", by_alias=True)
        stored = self.credential or (
            self.credentials.load(self.server, node.name) if self.credentials else None
        )
        data = None
        if stored:
            try:
                data = self._call("POST", "/register", token=stored, json=body)
                self.credential = stored
            except AgentApiError as exc:
                if exc.status != 401:
                    raise
                log.warning("the control plane no longer accepts this node's credential; enrolling again")
                self.credential = None
                if self.credentials is not None:
                    self.credentials.forget()
        if data is None:
            if not self.join_token:
                raise AgentApiError(
                    f"node {node.name} has no credential for {self.server}, and no join token to enrol "
                    "with: give --token-file or FLEETSERVE_JOIN_TOKEN"
                )
            data = self._call("POST", "/register", token=self.join_token, json=body)
        registered = Registered.model_validate(data)
        if registered.credential:
            self.credential = registered.credential
            if self.credentials is not None:
                self.credentials.save(self.server, node.name, registered.credential)
        if registered.held is not None:
            log.warning(
                "node %s claims %s, more than the operator approved (%s): it is placed with the "
                "approved hardware until an operator runs `fleetserve nodes approve %s`",
                node.name, registered.held.claimed.describe(), registered.held.approved.describe(), node.name,
            )  # fmt: skip
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
        reply = self._call("POST", "/status", json=body, timeout=self.report_timeout)
        return StatusReply.model_validate(reply).stop

    def model_file_url(self, name: str) -> str:
        """Where the server serves a model file it holds."""
        return f"{self.server}{API}/models/{name}/file"
