"""How long `python -m vldist.train --help` takes from the shell: the best of --runs fresh
processes (interpreter start, imports, job loading and printing), as JSON on stdout.

    python bench/help_time.py [--runs 5] [--job vsrn]

The best run, not the mean: on a shared machine the other runs mostly measure the neighbours.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def time_help(job: str | None) -> float:
    command = [sys.executable, "-m", "vldist.train", *([job] if job else []), "--help"]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--job", default=None, help="job whose keys --help lists (default: the command's own, vsrn)")
    args = parser.parse_args()
    seconds = [time_help(args.job) for _ in range(args.runs)]
    print(
        json.dumps(
            {
                "command": f"python -m vldist.train {args.job + ' ' if args.job else ''}--help",
                "runs": args.runs,
                "best_s": round(min(seconds), 3),
                "seconds": [round(s, 3) for s in seconds],
            }
        )
    )


if __name__ == "__main__":
    main()
