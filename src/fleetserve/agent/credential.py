"""The node's credential on disk: issued by the control plane at enrolment, bound to the node's
name, kept in one 0600 file (written atomically) with the server and name it is for, so a
restarted agent registers with it instead of enrolling again.

The server's URL is how the agent tells one control plane from another: it sends the credential
only to the URL it enrolled with. When the same control plane answers at another URL, whoever
knows so says it with ``rebind`` (``fleetserve up`` does, for the state store in its data
directory started on another port); otherwise the agent enrols again there, and a name enrolled
already waits for an operator's approval."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fleetserve.secretfile import write_secret


@dataclass(frozen=True)
class CredentialFile:
    """Where an agent keeps its node credential."""

    path: Path

    def load(self, server: str, node: str) -> str | None:
        """The credential stored for ``node`` on ``server``; None if there is none (or it is for
        another server or name, or unreadable)."""
        try:
            data: Any = yaml.safe_load(self.path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return None
        if not isinstance(data, dict) or data.get("server") != server or data.get("node") != node:
            return None
        credential = data.get("credential")
        return credential if isinstance(credential, str) and credential else None

    def save(self, server: str, node: str, credential: str) -> None:
        """Keep ``credential`` (0600, atomically)."""
        write_secret(self.path, yaml.safe_dump({"server": server, "node": node, "credential": credential}))

    def rebind(self, server: str) -> None:
        """The control plane that issued the stored credential now answers at ``server``: keep the
        credential for that URL (nothing stored, or unreadable: nothing to do)."""
        try:
            data: Any = yaml.safe_load(self.path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return
        if not isinstance(data, dict) or data.get("server") == server:
            return
        node, credential = data.get("node"), data.get("credential")
        if isinstance(node, str) and node and isinstance(credential, str) and credential:
            self.save(server, node, credential)

    def forget(self) -> None:
        """Drop a credential the server no longer accepts."""
        self.path.unlink(missing_ok=True)
