"""Conversion throughput (samples per second) of `python -m vldist.shards convert`.

    python bench/convert_throughput.py [--images 1000] [--precomp 2000] [--workers 1 2] [--shard-size 100]

Builds format-faithful inputs with the tests' fixture generators (tests/dataset_fixtures.py):
a COCO-style Karpathy set of rendered JPEGs (`--image-size`, default 256 px) and a precomp set of
(N, 36, 2048) float32 features, then times each conversion through the command line, as a user
runs it (process start and planning included). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dataset_fixtures import make_karpathy, make_precomp  # noqa: E402


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "vldist.shards", "convert", *argv, "--quiet"], check=True, capture_output=True, text=True
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000, help="karpathy images (default 1000)")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--precomp", type=int, default=2000, help="precomp images (default 2000)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--shard-size", type=int, default=100, help="samples per shard (default 100): workers share out whole shards"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n = args.images
        make_karpathy(tmp / "coco", {"train": n - n // 5, "test": n // 5}, image_size=args.image_size)
        make_precomp(tmp / "precomp", {"train": args.precomp}, regions=36, dim=2048, ids=True, boxes=False)
        src = ["--src", str(tmp / "coco" / "dataset_coco.json"), "--images", str(tmp / "coco" / "images")]
        cases = [
            ("karpathy, images only", n, ["karpathy", *src, "--no-features"]),
            ("karpathy, features 224 px, 36 regions", n, ["karpathy", *src]),
            ("precomp 36 x 2048, float16", args.precomp, ["precomp", "--src", str(tmp / "precomp")]),
        ]
        print("| conversion | samples | workers | seconds | samples/s |\n|---|---|---|---|---|")
        for name, samples, argv in cases:
            for workers in args.workers:
                out = tmp / f"out-{len(name)}-{workers}"
                seconds = timed(
                    [*argv, "--out", str(out), "--workers", str(workers), "--shard-size", str(args.shard_size)]
                )
                print(f"| {name} | {samples} | {workers} | {seconds:.1f} | {samples / seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
