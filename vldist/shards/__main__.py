"""Command line for shard sets: `python -m vldist.shards synth --out shards/synth`,
`python -m vldist.shards verify shards/synth`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _add_synth(sub) -> None:
    p = sub.add_parser(
        "synth",
        help="render the synthetic shapes dataset (images, 5 captions, region features)",
        description="Render scenes of 1-4 coloured shapes, write five captions per image and ResNet "
                    "region features into WebDataset shards. The same arguments give the same bytes.",
    )
    p.add_argument("--out", required=True, type=Path, help="directory to create, e.g. shards/synth")
    p.add_argument("--train", type=int, default=5000, help="train images (default 5000)")
    p.add_argument("--val", type=int, default=500, help="validation images (default 500)")
    p.add_argument("--test", type=int, default=1000, help="test images (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="data seed; each split derives its own stream (default 0)")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per tar shard (default 1000)")
    p.add_argument("--image-size", type=int, default=128, help="image side in pixels (default 128)")
    p.add_argument("--feature-size", type=int, default=96, help="side the feature extractor resizes images to (default 96)")
    p.add_argument("--layer", default="layer2", choices=["layer1", "layer2", "layer3", "layer4"],
                   help="ResNet stage the region features come from (default layer2; with --weights use layer4)")
    p.add_argument("--grid", type=int, default=2,
                   help="roi_align grid side: a region row has channels x grid^2 values (default 2; with layer4 use 1)")
    p.add_argument("--backbone", default="resnet50", help="torchvision ResNet for region features (default resnet50)")
    p.add_argument("--weights", default=None,
                   help="torchvision weight name, e.g. IMAGENET1K_V2 (needs a download); default: seeded random")
    p.add_argument("--overwrite", action="store_true", help="replace an existing shard set at --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_synth(args) -> int:
    from .synth import build_synth  # imports torch: only when the command runs

    start = time.perf_counter()
    manifest = build_synth(
        args.out, n_train=args.train, n_val=args.val, n_test=args.test, seed=args.seed,
        shard_size=args.shard_size, image_size=args.image_size, feature_size=args.feature_size,
        backbone=args.backbone, weights=args.weights, progress=not args.quiet, overwrite=args.overwrite,
        layer=args.layer, grid=args.grid,
    )
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    splits = ", ".join(f"{name} {s['samples']} ({len(s['shards'])} shards)" for name, s in manifest["splits"].items())
    print(f"wrote {args.out}: {splits}; {size / 2**20:.1f} MiB in {seconds:.1f} s")
    return 0


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="re-read every sample of a shard set and report problems by shard and key",
        description="Check a shard set against its manifest (files, sha256, counts) and decode every "
                    "member of every sample. Exits 0 when all is well, 1 when it found problems.",
    )
    p.add_argument("dir", type=Path, help="the shard set directory")
    p.add_argument("--max-problems", type=int, default=50, help="problems to print (default 50; all are counted)")


def _run_verify(args) -> int:
    from .verify import verify

    start = time.perf_counter()
    report = verify(args.dir)
    for line in report.problems[: args.max_problems]:
        print(f"problem: {line}")
    if len(report.problems) > args.max_problems:
        print(f"... and {len(report.problems) - args.max_problems} more")
    counts = ", ".join(f"{split} {n}" for split, n in report.samples.items()) or "no samples"
    verdict = "ok" if report.ok else f"{len(report.problems)} problems"
    print(f"{args.dir}: {counts}; {verdict} ({time.perf_counter() - start:.1f} s)")
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vldist.shards", description="Build shard sets.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_synth(sub)
    _add_verify(sub)
    # `convert` (COCO, Flickr30K, CUB, ...) is to be added here.
    args = parser.parse_args(argv)
    try:
        if args.command == "synth":
            return _run_synth(args)
        if args.command == "verify":
            return _run_verify(args)
    except (FileExistsError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
