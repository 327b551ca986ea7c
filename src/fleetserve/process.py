"""Child processes that never outlive the process that started them, and process-group checks.

The supervisor starts engines with ``die_with_parent`` and ``fleetserve up`` starts its server and
agent with it: Linux's ``PR_SET_PDEATHSIG`` sends the child SIGKILL when the thread that forked it
ends, so nothing is left behind even when the parent is killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask the kernel to SIGKILL this process when its parent thread ends (a ``preexec_fn``)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
