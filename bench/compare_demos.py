"""Do two checkouts' demo runs print and record the same numbers? (issue 24's check)

    python bench/compare_demos.py RUNS_A RUNS_B vsrn two_branch_embed l2c cl_caption laviter

Each NAME is a demo run in both roots: RUNS_x/NAME.log (its console output) and RUNS_x/NAME/ (its
output.dir), made by `OMP_NUM_THREADS=1 python -m vldist.train NAME output.dir=RUNS_x/NAME >
RUNS_x/NAME.log 2>&1` on each checkout. Compares every loss, validation and table line of the logs,
every number of each stage's metrics.json and the bytes of every PNG it wrote; timings, speeds,
ports and the roots' own paths are left out. Exits 1 when any demo differs.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import sys
from pathlib import Path

# what differs between two runs of one computation: clocks, speeds, ports (or another run holding the
# metrics port), Java's tokenizer speed
TIMING = re.compile(
    r"tokens per second|Prometheus metrics on|metrics port \S+ is in use|WARNING|\bit/s\b|\d+:\d\d:\d\d|min \d+ s|^\s*$"
)
NOT_NUMBERS = re.compile(r"second|time|wall|path|dir|checkpoint|config|throughput|per_s")


def log_lines(root: Path, name: str) -> list[str]:
    lines = []
    for line in (root / f"{name}.log").read_text().splitlines():
        line = re.sub(r"^\d\d:\d\d:\d\d ", "", line).replace(str(root), "ROOT")
        line = re.sub(r"\|\s*[\d.]+ \w+/s\b.*$", "", line)  # a step line's speed, data wait and eta
        line = re.sub(r"\bin [\d.]+ ?s\b", "in _ s", line)
        if not TIMING.search(line):
            lines.append(line)
    return lines


def numbers(value, root: Path):
    if isinstance(value, dict):
        return {k: numbers(v, root) for k, v in value.items() if not NOT_NUMBERS.search(k)}
    if isinstance(value, list):
        return [numbers(v, root) for v in value]
    return value.replace(str(root), "ROOT") if isinstance(value, str) else value


def same_files(a: Path, b: Path, pattern: str, read) -> tuple[int, bool]:
    fa, fb = sorted(a.rglob(pattern)), sorted(b.rglob(pattern))
    same = [f.relative_to(a) for f in fa] == [f.relative_to(b) for f in fb] and all(
        read(x, a) == read(y, b) for x, y in zip(fa, fb, strict=True)
    )
    return len(fa), same


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        sys.exit(__doc__)
    root_a, root_b, names = Path(argv[0]).resolve(), Path(argv[1]).resolve(), argv[2:]
    differ = 0
    for name in names:
        a, b = log_lines(root_a, name), log_lines(root_b, name)
        n_metrics, metrics_same = same_files(
            root_a / name, root_b / name, "metrics.json", lambda f, root: numbers(json.loads(f.read_text()), root)
        )
        n_png, png_same = same_files(
            root_a / name, root_b / name, "*.png", lambda f, root: hashlib.sha256(f.read_bytes()).digest()
        )
        same = a == b and metrics_same and png_same
        differ += not same
        print(
            f"{name}: {'identical' if same else 'DIFFERENT'} (log lines {len(a)}: {a == b}; "
            f"metrics.json {n_metrics}: {metrics_same}; pictures {n_png}: {png_same})"
        )
        if a != b:
            print("\n".join(list(difflib.unified_diff(a, b, lineterm=""))[:40]))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
