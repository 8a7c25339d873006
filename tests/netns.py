"""Nodes for multi-node tests on one machine: Linux network namespaces, each with its own hostname
(a UTS namespace per process) and /etc/hosts (bind-mounted in a mount namespace of its own),
joined through veth pairs to a bridge that lives in a namespace of its own too. Addresses come from
198.18.0.0/15, the range reserved for network tests, and exist only inside these namespaces: no
packet leaves them, and the machine's own interfaces are never touched.

    with Nodes(2) as nodes:            # node0 198.18.0.1, node1 198.18.0.2
        proc = nodes.popen(1, ["python", "-c", "import socket; print(socket.gethostname())"])

Everything is torn down by name and process id when the block ends, whatever happened in it:
the processes started on the nodes (each in its own session, killed with its group), then the
namespaces (which take their veth ends and the bridge with them). Needs root (`unavailable()`
says why not, for a skip)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

SUBNET = "198.18.0"  # node i is SUBNET.(i+1)/24, inside the namespaces only


def unavailable() -> str | None:
    """Why nodes cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    probe = f"vlt{secrets.token_hex(3)}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Nodes:
    def __init__(self, count: int, prefix: str = "node", own_name_loopback: bool = False):
        """own_name_loopback: each node's /etc/hosts maps its own name to 127.0.1.1, as Debian's
        installer writes it (the other nodes' names to their addresses)."""
        self.count = count
        self.tag = f"vlt{secrets.token_hex(3)}"  # names of this set's namespaces and links
        self.bridge = f"{self.tag}-br"
        self.namespaces = [f"{self.tag}-n{i}" for i in range(count)]
        self.hostnames = [f"{prefix}{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.interface = "eth0"  # every node's link to the bridge
        self.processes: list[subprocess.Popen] = []
        self.own_name_loopback = own_name_loopback
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))

    def __enter__(self) -> Nodes:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "set", "lo", "up")
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            _ip("netns", "add", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            port = f"{self.tag}-p{i}"  # the bridge's end; created in the node's namespace, so the
            _ip(
                "-n",
                namespace,
                "link",
                "add",
                self.interface,
                "type",
                "veth",
                "peer",
                "name",
                port,  # machine's own
                "netns",
                self.bridge,
            )  # never sees it
            _ip("-n", self.bridge, "link", "set", port, "master", "br0")
            _ip("-n", self.bridge, "link", "set", port, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", self.interface)
            _ip("-n", namespace, "link", "set", self.interface, "up")
        for node in range(self.count):
            self.hosts_file(node).write_text(
                "127.0.0.1 localhost\n"
                + "".join(
                    f"{'127.0.1.1' if self.own_name_loopback and i == node else address} {name}\n"
                    for i, (address, name) in enumerate(zip(self.addresses, self.hostnames, strict=True))
                )
            )

    def hosts_file(self, node: int) -> Path:
        return self._scratch / f"hosts.{node}"

    def command(self, node: int, argv: list[str], hosts: bool = True, hidden: tuple = ()) -> list[str]:
        """`argv` as run on `node`: in its network namespace, under its hostname, with the nodes'
        /etc/hosts (hosts=False: the machine's, where the other nodes' names do not resolve);
        each `hidden` directory looks empty there (a tmpfs over it), as a disk the node lacks."""
        setup = f"mount --bind {self.hosts_file(node)} /etc/hosts && " if hosts else ""
        setup += "".join(f"mount -t tmpfs vldist-test-hidden {shlex.quote(str(path))} && " for path in hidden)
        # nsenter --net, not `ip netns exec`: that one mounts the namespace's own /sys, without the
        # cgroup filesystems slurmd needs
        return [
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "nsenter",
            self._net(node),
            "sh",
            "-c",
            f'{setup}hostname {self.hostnames[node]} && exec "$@"',
            "sh",
            *argv,
        ]

    def _net(self, node: int) -> str:
        return f"--net=/run/netns/{self.namespaces[node]}"

    def popen(self, node: int, argv: list[str], hosts: bool = True, hidden: tuple = (), **kwargs) -> subprocess.Popen:
        """Start `argv` on `node` in a session of its own (killed with its group at the end)."""
        process = subprocess.Popen(self.command(node, argv, hosts, hidden), start_new_session=True, **kwargs)
        self.processes.append(process)
        return process

    def pids(self, node: int) -> list[int]:
        """Every process in the node's network namespace (`ip netns pids`): also those that left
        the session they were started in (torchrun starts its ranks in sessions of their own)."""
        listed = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True)
        return [int(pid) for pid in listed.stdout.split()]

    def freeze(self, node: int) -> None:
        """Stop every process of `node` (SIGSTOP), as a host that stops answering but keeps its
        connections open; power_off or close ends them."""
        for pid in self.pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def power_off(self, node: int) -> None:
        """Kill every process of `node` at once, as a node that loses power loses them."""
        for _ in range(3):  # a process forking meanwhile leaves a child: look again
            for pid in self.pids(node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for process in self.processes:  # reap those started there
            if self._net(node) in process.args:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(30)

    def close(self) -> None:
        for node in range(self.count):
            self.power_off(node)
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(30)
        for namespace in [*self.namespaces, self.bridge]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        shutil.rmtree(self._scratch, ignore_errors=True)
