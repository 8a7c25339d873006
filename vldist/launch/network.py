"""The network interface gloo uses between hosts.

Unless GLOO_SOCKET_IFNAME names an interface, gloo binds each rank to the address its host's own
name resolves to and tells the other ranks that address. Where a host's name resolves to a
loopback address (Debian's installer writes `127.0.1.1 <hostname>` into /etc/hosts, and many
container images do alike), the other hosts are told to connect to 127.0.1.1 and the first
collective fails ("connectFullMesh failed ... remote=[127.0.1.1]") or hangs. The interface that
routes to the rendezvous host (MASTER_ADDR) is one every rank can reach, so a multi-host run
without GLOO_SOCKET_IFNAME uses that one; a user's GLOO_SOCKET_IFNAME is always kept.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import MutableMapping


def interface_towards(host: str) -> str | None:
    """The name of the interface this machine would reach `host` (IPv4) through; None when that
    is a loopback route."""
    import psutil

    address = socket.gethostbyname(host)
    if ipaddress.ip_address(address).is_loopback:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # a UDP connect picks the route and the source address; it sends nothing
        local = probe.getsockname()[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addresses):
            return None if ipaddress.ip_address(local).is_loopback else name
    return None


def choose_gloo_interface(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface towards MASTER_ADDR for a run of several hosts
    whose user has not set it; returns the interface set, or None (nothing changed)."""
    if "GLOO_SOCKET_IFNAME" in env or not env.get("MASTER_ADDR"):
        return None
    if env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE", "1"):  # one host (torchrun says so): gloo's default is right
        return None
    try:
        name = interface_towards(env["MASTER_ADDR"])
    except OSError:
        return None  # an address that does not resolve: torch's own error names it
    if name is not None:
        env["GLOO_SOCKET_IFNAME"] = name
    return name
