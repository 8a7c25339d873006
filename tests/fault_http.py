"""A static HTTP server on 127.0.0.1 that fails on request, for the remote-shard tests: it serves
a directory (as Python's http.server does, ignoring Range requests, as many static servers do) and,
per file, cuts the connection after a number of bytes of a response, or answers with an error
status, as a planned sequence of faults, or goes down altogether; it counts every GET of each file."""

from __future__ import annotations

import functools
import threading
from collections import Counter, defaultdict
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Faults:
    """What the server does to the next GETs of each file (by name): `cut[name]` a list of byte
    counts (each response of the list sent with its full Content-Length, then cut after that many
    bytes), `status[name]` a list of error statuses answered first, `always[name]` a status
    answered to every GET."""

    def __init__(self):
        self.lock = threading.Lock()
        self.cut: dict[str, list[int]] = defaultdict(list)
        self.status: dict[str, list[int]] = defaultdict(list)
        self.always: dict[str, int] = {}
        self.down = False  # every request, files and listings, answered 503
        self.gets: Counter = Counter()
        self.cuts: Counter = Counter()

    def next_fault(self, name: str) -> tuple[str, int] | None:
        with self.lock:
            self.gets[name] += 1
            if name in self.always:
                return "status", self.always[name]
            if self.status[name]:
                return "status", self.status[name].pop(0)
            if self.cut[name]:
                self.cuts[name] += 1
                return "cut", self.cut[name].pop(0)
        return None


class _Handler(SimpleHTTPRequestHandler):
    faults: Faults

    def log_message(self, *args):  # the test's output stays the job's
        pass

    def do_HEAD(self):
        if self.faults.down:
            self.send_error(503, "store down (fault injected by the test)")
            return
        super().do_HEAD()

    def do_GET(self):
        if self.faults.down:
            self.send_error(503, "store down (fault injected by the test)")
            return
        path = Path(self.translate_path(self.path))
        fault = self.faults.next_fault(path.name) if path.is_file() else None
        if fault is None:
            return super().do_GET()
        kind, value = fault
        if kind == "status":
            self.send_error(value, "fault injected by the test")
            return
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[:value])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(2)  # the rest never comes: the client sees a short body


class FaultyServer:
    """`with FaultyServer(directory) as server:` serves `directory` at server.url until the block ends."""

    def __init__(self, directory: Path):
        self.faults = Faults()
        handler = functools.partial(type("Handler", (_Handler,), {"faults": self.faults}), directory=str(directory))
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="faulty-http", daemon=True)

    def __enter__(self) -> FaultyServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)
