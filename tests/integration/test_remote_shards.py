"""Training and evaluation read a shard set from a URL exactly as from disk: the planted set served
by a real HTTP server on 127.0.0.1 (Python's http.server, which ignores Range requests as many
static servers do), read through fsspec's HTTP filesystem by the job and its loader workers."""

from __future__ import annotations

import functools
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import SMALL_VSRN

pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp (pip install \"vldist[http]\")")


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test's output stays the job's
        pass


@pytest.fixture(scope="module")
def served_shards(planted_shards):
    """http://127.0.0.1:<port>/shards: the planted set, served until the module's tests end."""
    handler = functools.partial(QuietHandler, directory=str(planted_shards.parent))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="shard-http", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/{planted_shards.name}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_a_job_trains_from_a_url_as_from_disk(planted_shards, served_shards, tmp_path):
    from vldist.train import main as train_main

    runs = {}
    for name, shards in (("local", planted_shards), ("http", served_shards)):
        out = tmp_path / name
        # two loader workers: each opens its own HTTP filesystem after the fork
        assert train_main(["vsrn", f"data.shards={shards}", f"output.dir={out}", "train.epochs=1", "data.workers=2",
                           *SMALL_VSRN]) == 0
        runs[name] = json.loads((out / "metrics.json").read_text())
    assert runs["http"]["test"] == runs["local"]["test"]
    assert runs["http"]["config"]["data"]["shards"] == served_shards
    losses = [json.loads(line)["loss"] for name in runs for line in (tmp_path / name / "metrics.jsonl").open()
              if '"loss"' in line]
    half = len(losses) // 2
    assert half > 0 and losses[:half] == losses[half:]
