"""The Ray address a driver joins (`--address`, else `RAY_ADDRESS`), checked before Ray is asked.

Asked directly, ray.init answers a malformed address with a bare ValueError and an address where
no Ray listens with minutes of retries and raw GCS log lines. The driver hosts the ranks'
rendezvous and must run on a node of the cluster, so the address is the GCS's `host:port` (what
`ray start --head` prints, port 6379 by default) or `auto` (the cluster this node joined); a
dashboard URL (`http://...:8265`, what `ray job submit` takes) or a Ray Client URL (`ray://`)
cannot work. Protocol: `ray_cluster.connect` calls `check_address` first and turns what ray.init
still raises into `RayAddressError` with `unreachable`; the CLI prints its one line and exits 2.
"""

from __future__ import annotations

import socket

FIX = ("use the head's GCS address as `ray start --head` printed it (host:6379), `auto` on a node of the "
       "cluster, or no address for a local Ray")


class RayAddressError(ValueError):
    """The address cannot reach a Ray cluster; the message names where it came from and the fix."""


def check_address(address: str, source: str, timeout_s: float = 5.0) -> None:
    """Raise RayAddressError unless `address` is `auto`, `local` or a `host:port` that accepts a
    connection within `timeout_s`; `source` names where it came from (`--address` or `RAY_ADDRESS`)."""
    said = f"{source} {address!r}"
    if address in ("auto", "local"):  # this node's cluster; a new local one (what Ray means by them)
        return
    if address.startswith(("http://", "https://")):
        raise RayAddressError(f"{said}: a dashboard URL, for `ray job submit`; `undying run` joins the cluster "
                              f"itself (submit it as the job's entrypoint), so {FIX}")
    if "://" in address:
        raise RayAddressError(f"{said}: the driver hosts the ranks' rendezvous, so it runs on a node of the "
                              f"cluster (Ray Client and other schemes cannot work): {FIX}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayAddressError(f"{said}: not host:port; {FIX}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise RayAddressError(f"{said}: nothing answers there ({reason}); is the cluster up? {FIX}") from None


def unreachable(address: str, source: str, err: Exception) -> RayAddressError:
    """What ray.init raised for an address that passed `check_address` (a port that is not Ray's,
    or `auto` on a node that joined no cluster), as one line."""
    return RayAddressError(f"{source} {address!r}: Ray could not join a cluster there "
                           f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); {FIX}")
