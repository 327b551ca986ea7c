"""Where the control plane reads an Endpoint's API key: a file in its ``--endpoint-keys``
directory, named by the Endpoint's ``keyFile``.

The key is never applied, stored, logged or answered: the control plane's processes (the server,
which checks the Endpoint's health, and every gateway, which relays requests to it; gateways are
part of the control plane, as they hold its database and every replica's engine key) read it from
their own directory when they need it, so a key rotated in the file is used from the next read.
Only files in that directory are read, by a bare name: an Endpoint cannot make the control plane
send some other file of its host (``/etc/shadow``, an SSH key) to a URL an operator chose.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fleetserve.secretfile import read_secret

DEFAULT_DIR = Path("fleetserve-endpoint-keys")
# A key is a line of printable ASCII (it goes into an Authorization header); a file larger than
# this is no key.
MAX_KEY_BYTES = 8192


@dataclass(frozen=True)
class KeyUnreadable:
    """Why an Endpoint's key could not be read (the file's name, never its content)."""

    reason: str


@dataclass(frozen=True)
class EndpointKeys:
    """The directory Endpoint keys are read from."""

    directory: Path = DEFAULT_DIR

    def read(self, key_file: str | None) -> str | KeyUnreadable | None:
        """The key in ``key_file`` (None for an Endpoint without one), or why it cannot be read."""
        if key_file is None:
            return None
        if "/" in key_file or key_file.startswith(".") or not key_file:
            return KeyUnreadable(f"keyFile {key_file!r} is not a bare file name")
        path = self.directory / key_file
        try:
            if path.is_symlink() or not path.is_file():
                return KeyUnreadable(f"{path} is not a regular file in --endpoint-keys")
            if path.stat().st_size > MAX_KEY_BYTES:
                return KeyUnreadable(f"{path} is larger than {MAX_KEY_BYTES} bytes: not a key")
            key = read_secret(path)
        except (OSError, UnicodeDecodeError) as exc:
            return KeyUnreadable(
                f"cannot read {path}: {getattr(exc, 'strerror', None) or type(exc).__name__}"
            )
        if not key or not key.isascii() or not key.isprintable() or " " in key:
            return KeyUnreadable(f"{path} does not hold one line of printable ASCII without spaces")
        return key
