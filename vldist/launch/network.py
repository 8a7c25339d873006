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


def address_towards(host: str) -> str | None:
    """This machine's own IPv4 address on the route to `host`; None when that is a loopback route."""
    address = socket.gethostbyname(host)
    if ipaddress.ip_address(address).is_loopback:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # a UDP connect picks the route and the source address; it sends nothing
        local = probe.getsockname()[0]
    return None if ipaddress.ip_address(local).is_loopback else local


def interface_towards(host: str) -> str | None:
    """The name of the interface this machine would reach `host` (IPv4) through; None when that
    is a loopback route."""
    import psutil

    local = address_towards(host)
    if local is None:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addresses):
            return name
    return None


def node_address(env: MutableMapping[str, str] = os.environ) -> str:
    """The address the other nodes reach this one at: the one on the route to the rendezvous host
    (MASTER_ADDR); 127.0.0.1 in a one-host run (MASTER_ADDR on loopback, or unset)."""
    try:
        return address_towards(env["MASTER_ADDR"]) or "127.0.0.1"
    except (KeyError, OSError):
        return "127.0.0.1"


def choose_gloo_interface(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface towards MASTER_ADDR for a run of several hosts
    whose user has not set it; returns the interface set, or None (nothing changed)."""
    if "GLOO_SOCKET_IFNAME" in env or not env.get("MASTER_ADDR"):
        return None
    if env.get("LOCAL_WORLD_SIZE") == env.get(
        "WORLD_SIZE", "1"
    ):  # one host (torchrun says so): gloo's default is right
        return None
    try:
        name = interface_towards(env["MASTER_ADDR"])
    except OSError:
        return None  # an address that does not resolve: torch's own error names it
    if name is not None:
        env["GLOO_SOCKET_IFNAME"] = name
    return name
