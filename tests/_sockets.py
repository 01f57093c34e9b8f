"""The listening TCP sockets of a process, read from /proc (no psutil): its socket inodes in
/proc/<pid>/fd matched against the LISTEN rows of /proc/<pid>/net/tcp and tcp6."""

from __future__ import annotations

import ipaddress
import os

_LISTEN = "0A"


def _inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            out.add(target[len("socket:["):-1])
    return out


def _address(hex_ip: str) -> str:
    """/proc/net/tcp writes addresses as host-order 32-bit words in hex."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening_sockets(pid: int | None = None) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` (default: this process) listens on; the
    wildcard reads "0.0.0.0" or "::"."""
    pid = pid or os.getpid()
    inodes = _inodes(pid)
    out = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    hex_ip, hex_port = fields[1].split(":")
                    out.add((_address(hex_ip), int(hex_port, 16)))
    return out


def wildcard(sockets: set[tuple[str, int]]) -> set[tuple[str, int]]:
    return {(ip, port) for ip, port in sockets if ip in ("0.0.0.0", "::")}
