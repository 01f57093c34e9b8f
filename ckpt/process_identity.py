"""Name this process so that another process can tell later whether it still runs.

`this_process()` is recorded in an owner claim (ckpt.ownership); `gone(identity)` is asked by
whoever reads that claim. The answer is "gone" only when it is certain: the reader is on the
same host (same hostname, same kernel boot, same PID namespace, so the PID means the same
process table) and the PID is free or now belongs to a process that started at another time
(the PID was reused). Anything else, another host above all, is "not known to be gone": the
caller then watches the claim's heartbeat instead.
"""

from __future__ import annotations

import os
import socket


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def host_id() -> str:
    """This host as a PID sees it: hostname, plus on Linux the boot id and the PID namespace
    (two containers on one kernel share the boot id but not the namespace)."""
    parts = [socket.gethostname(), _read("/proc/sys/kernel/random/boot_id") or ""]
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    return "/".join(parts)


def start_time(pid: int) -> str | None:
    """When `pid` started, in clock ticks since boot (Linux /proc; None elsewhere or when it is gone)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its last ')'.
    return stat.rsplit(")", 1)[1].split()[19]


def this_process() -> dict:
    """{"host", "pid", "started"} of the calling process."""
    pid = os.getpid()
    return {"host": host_id(), "pid": pid, "started": start_time(pid)}


def gone(identity: dict) -> bool:
    """Whether the process `identity` (from `this_process`, possibly elsewhere) has certainly ended."""
    if identity.get("host") != host_id():
        return False
    pid = int(identity.get("pid", 0))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the PID exists
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, under another user
    recorded = identity.get("started")
    return recorded is not None and start_time(pid) not in (None, recorded)
