"""A TCP proxy on 127.0.0.1 in front of a real store (the S3 tests' SeaweedFS) that fails on
request: per object name it answers a planned number of requests with 503 Slow Down, stalls a
response before its first byte, or cuts the connection after a number of response bytes, and
counts the requests for each name; or it holds every request whose path contains a given string,
forwarding none (a client killed while waiting, as in the middle of an upload). It understands just enough HTTP for that: the request line,
and a `Connection: close` it adds to each request so that every connection carries one exchange
(the store then closes it, and the proxy knows where a response ends)."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter, defaultdict
from urllib.parse import unquote, urlsplit

SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>fault injected by the test</Message></Error>"
)


class ProxyFaults:
    """The next faults per object name (the last path component): `slow_down[name]` requests
    answered 503 first, then `stall[name]` (seconds, one per response) and `cut[name]` (response
    bytes, one per response) on the GETs that reach the store."""

    def __init__(self):
        self.lock = threading.Lock()
        self.slow_down: Counter = Counter()
        self.stall: dict[str, list[float]] = defaultdict(list)
        self.cut: dict[str, list[int]] = defaultdict(list)
        self.requests: Counter = Counter()
        self.hold: str | None = None  # a request whose path holds this is held (never forwarded) ...
        self.held = threading.Event()  # ... and this is set when one arrives

    def take(self, method: str, name: str) -> tuple[str, float] | None:
        with self.lock:
            self.requests[name] += 1
            if self.slow_down[name] > 0:
                self.slow_down[name] -= 1
                return "503", 0
            if method != "GET":
                return None
            if self.stall[name]:
                return "stall", self.stall[name].pop(0)
            if self.cut[name]:
                return "cut", self.cut[name].pop(0)
        return None


def _read_head(conn: socket.socket) -> tuple[bytes, bytes]:
    """(request head up to and with its blank line, the bytes read after it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _one_exchange(head: bytes) -> bytes:
    """The head with any Connection header replaced by `Connection: close`."""
    lines = [line for line in head.rstrip(b"\r\n").split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


class FaultProxy:
    """`with FaultProxy("http://127.0.0.1:8333") as proxy:` forwards proxy.url to the store."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.faults = ProxyFaults()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        self._server.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            self._exchange(client)
        except OSError:
            pass  # the client gave up (its read timed out during a stall) or the store closed: the exchange is over
        finally:
            client.close()

    def _exchange(self, client: socket.socket) -> None:
        head, rest = _read_head(client)
        if not head:
            return
        method, target = head.split(b" ", 2)[:2]
        path = unquote(urlsplit(target.decode()).path)
        if self.faults.hold is not None and self.faults.hold in path:
            self.faults.held.set()  # the client waits for an answer that never comes
            self._closing.wait(300)
            return
        name = path.rstrip("/").rsplit("/", 1)[-1]
        fault = self.faults.take(method.decode(), name)
        if fault and fault[0] == "503":
            client.sendall(SLOW_DOWN % (len(SLOW_DOWN_BODY), SLOW_DOWN_BODY))
            return
        with socket.create_connection(self.upstream, timeout=30) as store:
            store.sendall(_one_exchange(head) + rest)
            threading.Thread(target=self._pipe, args=(client, store), daemon=True).start()  # a request body
            if fault and fault[0] == "stall":
                time.sleep(fault[1])
            budget = int(fault[1]) if fault and fault[0] == "cut" else None
            while budget is None or budget > 0:
                chunk = store.recv(65536)
                if not chunk:
                    break
                if budget is not None:
                    chunk, budget = chunk[:budget], budget - len(chunk)
                client.sendall(chunk)
        if budget is not None and budget <= 0:  # cut: the client sees its response end early
            client.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass  # either side closed: the exchange is over
