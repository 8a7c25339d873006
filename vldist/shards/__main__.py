"""Command line for shard sets: `python -m vldist.shards synth --out shards/synth`
(`--phrases hard --out shards/synth-hard`: the harder phrase variant),
`python -m vldist.shards synth-pairs --out shards/synth_pairs`,
`python -m vldist.shards convert <format> --src ... --out ...`, `python -m vldist.shards verify <dir>`,
`python -m vldist.shards index <dir>`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from vldist.errors import OutputNotWritable
from vldist.shards.features.extractor_args import add_extractor_arguments
from vldist.store.location import is_url, redact


def _add_synth(sub) -> None:
    p = sub.add_parser(
        "synth",
        help="render the synthetic shapes dataset (images, 5 captions, region features)",
        description="Render scenes of 1-4 coloured shapes, write five captions per image and ResNet "
        "region features into WebDataset shards. The same arguments give the same bytes.",
    )
    p.add_argument("--out", required=True, help="directory to create, e.g. shards/synth, or a URL (s3://bucket/synth)")
    p.add_argument("--train", type=int, default=5000, help="train images (default 5000)")
    p.add_argument("--val", type=int, default=500, help="validation images (default 500)")
    p.add_argument("--test", type=int, default=1000, help="test images (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="data seed; each split derives its own stream (default 0)")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per tar shard (default 1000)")
    p.add_argument("--image-size", type=int, default=128, help="image side in pixels (default 128)")
    add_extractor_arguments(p, input_size=96)
    p.add_argument(
        "--proposals",
        type=int,
        default=32,
        help="candidate boxes per image for phrase localisation, with features (default 32; 0: none)",
    )
    p.add_argument(
        "--phrases",
        choices=["standard", "hard"],
        default="standard",
        help="standard: scenes of 1-4 shapes, each of its own shape and colour (default); hard: the harder "
        "phrase variant, 5-8 shapes that may overlap, several of one shape and colour, told apart by "
        "phrases with relation words ('the red circle left of the blue square'), e.g. --out shards/synth-hard",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing shard set at --out")
    p.add_argument(
        "--stage", help="with --out URL: where the set is built before it is uploaded (default ~/.cache/vldist/staging)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_synth(args) -> int:
    from vldist.shards.synthetic.synth import build_synth  # imports torch: only when the command runs

    start = time.perf_counter()
    manifest = build_synth(
        args.out,
        n_train=args.train,
        n_val=args.val,
        n_test=args.test,
        seed=args.seed,
        shard_size=args.shard_size,
        image_size=args.image_size,
        feature_size=args.feature_size,
        backbone=args.backbone,
        weights=args.weights,
        progress=not args.quiet,
        overwrite=args.overwrite,
        layer=args.layer,
        grid=args.grid,
        proposals=args.proposals,
        phrases=args.phrases,
    )
    _report_build(args.out, manifest, time.perf_counter() - start)
    return 0


def _add_synth_pairs(sub) -> None:
    p = sub.add_parser(
        "synth-pairs",
        help="render the synthetic image pairs of L2C (two scenes, one change, its descriptions, masks)",
        description="Render pairs of scenes that differ by one change (colour, size, position or count), "
        "write about five descriptions of the difference per pair (naming image1 and image2) "
        "and both foreground masks into WebDataset shards. The same arguments give the same bytes.",
    )
    p.add_argument("--out", required=True, help="directory to create, e.g. shards/synth_pairs, or a URL")
    p.add_argument("--train", type=int, default=2000, help="train pairs (default 2000)")
    p.add_argument("--val", type=int, default=250, help="validation pairs (default 250)")
    p.add_argument("--test", type=int, default=500, help="test pairs (default 500)")
    p.add_argument("--seed", type=int, default=0, help="data seed; each split derives its own stream (default 0)")
    p.add_argument("--shard-size", type=int, default=500, help="samples per tar shard (default 500)")
    p.add_argument("--image-size", type=int, default=128, help="image side in pixels (default 128)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing shard set at --out")
    p.add_argument(
        "--stage", help="with --out URL: where the set is built before it is uploaded (default ~/.cache/vldist/staging)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_synth_pairs(args) -> int:
    from vldist.shards.synthetic.pairs import build_synth_pairs

    start = time.perf_counter()
    manifest = build_synth_pairs(
        args.out,
        n_train=args.train,
        n_val=args.val,
        n_test=args.test,
        seed=args.seed,
        shard_size=args.shard_size,
        image_size=args.image_size,
        progress=not args.quiet,
        overwrite=args.overwrite,
    )
    _report_build(args.out, manifest, time.perf_counter() - start, " pairs")
    return 0


def _report_build(out: Path, manifest: dict, seconds: float, unit: str = "") -> None:
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    splits = ", ".join(f"{name} {s['samples']} ({len(s['shards'])} shards)" for name, s in manifest["splits"].items())
    print(f"wrote {out}: {splits}{unit}; {size / 2**20:.1f} MiB in {seconds:.1f} s")


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="re-read every sample of a shard set and report problems by shard and key",
        description="Check a shard set against its manifest (files, sha256, counts) and decode every "
        "member of every sample. Exits 0 when all is well, 1 when it found problems.",
    )
    p.add_argument("dir", help="the shard set directory, or its URL (s3://..., https://...)")
    p.add_argument("--max-problems", type=int, default=50, help="problems to print (default 50; all are counted)")


def _run_verify(args) -> int:
    from vldist.shards.format.verify import verify

    start = time.perf_counter()
    report = verify(args.dir if is_url(args.dir) else Path(args.dir))
    for line in report.problems[: args.max_problems]:
        print(f"problem: {line}")
    if len(report.problems) > args.max_problems:
        print(f"... and {len(report.problems) - args.max_problems} more")
    counts = ", ".join(f"{split} {n}" for split, n in report.samples.items()) or "no samples"
    verdict = "ok" if report.ok else f"{len(report.problems)} problems"
    print(f"{args.dir}: {counts}; {verdict} ({time.perf_counter() - start:.1f} s)")
    return 0 if report.ok else 1


def _add_index(sub) -> None:
    p = sub.add_parser(
        "index",
        help="add each shard's sample index to a set written without one",
        description="Write <shard>.idx.json beside every shard that lacks one (with --force, every shard): "
        "where each sample's bytes lie, so that training reads only the samples a rank needs and resumes "
        "without reading the epoch before its position. Rerun after an interruption; verify checks them. "
        "A shard cut short (an interrupted copy) is refused by name with the byte where it breaks, and no "
        "index is written, unless --partial.",
    )
    p.add_argument("dir", help="the shard set directory, or its URL (s3://..., https://...)")
    p.add_argument("--force", action="store_true", help="rebuild every index, even those that fit their shard")
    p.add_argument(
        "--partial",
        action="store_true",
        help="a shard cut short (an interrupted copy): index its whole samples, leaving the rest out of training "
        "(without it, such a shard is refused by name and no index is written)",
    )


def _run_index(args) -> int:
    from vldist.shards.format.indexing import index_set

    start = time.perf_counter()
    try:
        done = index_set(args.dir if is_url(args.dir) else Path(args.dir), force=args.force, partial=args.partial)
    except KeyboardInterrupt:
        print("\ninterrupted: the indexes of the shards read so far are written; rerun to go on", file=sys.stderr)
        return 130
    for line in done.partial:
        print(f"partial: {line}")
    replaced = f" ({len(done.replaced)} replacing an index that no longer fit its shard)" if done.replaced else ""
    print(
        f"{redact(args.dir)}: indexed {len(done.written)} shards{replaced}, {len(done.kept)} had an index already "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return 0


def _add_convert(sub) -> None:
    from vldist.shards.convert import FORMATS

    p = sub.add_parser(
        "convert",
        help="convert a public dataset layout (COCO/Flickr30K Karpathy, precomp, CUB, Birds-to-Words, folder)",
        description="Convert a dataset in its usual layout into a shard set. Parallel, deterministic, "
        "resumable: rerun the same command after an interruption. See shards/README.md.",
    )
    formats = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    for name, converter in FORMATS.items():
        f = formats.add_parser(
            name,
            help=converter.summary,
            description=converter.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        f.add_argument("--src", required=True, type=Path, help="the source (see the description above)")
        f.add_argument("--out", required=True, help="the shard set directory to write, or a URL (s3://...)")
        f.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
        f.add_argument(
            "--workers",
            type=int,
            default=os.cpu_count() or 1,
            help="worker processes, each writing whole shards (default: the CPU count)",
        )
        f.add_argument(
            "--on-error",
            choices=["stop", "skip"],
            default="stop",
            help="bad input: stop at the first problem (default), or skip it and list it in <out>/skipped.jsonl",
        )
        f.add_argument("--overwrite", action="store_true", help="replace what --out holds")
        f.add_argument(
            "--stage",
            help="with --out URL: where the set is built before it is uploaded; a conversion "
            "interrupted there resumes (default ~/.cache/vldist/staging)",
        )
        f.add_argument("--quiet", action="store_true", help="no progress bar")
        f.add_argument(
            "--max-listed", type=int, default=20, help="skipped samples to print (default 20; all are in skipped.jsonl)"
        )
        converter.add_arguments(f)


def _run_convert(args) -> int:
    from vldist.shards.convert import FORMATS, BadInput, convert
    from vldist.shards.convert.engine import finished_shard_count

    try:
        result = convert(
            FORMATS[args.format],
            args,
            args.out,
            shard_size=args.shard_size,
            workers=args.workers,
            on_error=args.on_error,
            progress=not args.quiet,
            overwrite=args.overwrite,
        )
    except BadInput as bad:
        print(f"error: {bad}", file=sys.stderr)
        print(
            f"nothing written is lost: {finished_shard_count(args.out)} finished shards are kept, and rerunning the "
            "same command goes on from them once the input is fixed; --on-error skip leaves such samples out "
            "and lists them",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: {finished_shard_count(args.out)} finished shards are kept; rerun the same command to "
            "go on from them",
            file=sys.stderr,
        )
        return 130
    if result.already_done:
        print(f"{args.out} already holds this conversion (same input and options); nothing to do")
        return 0
    for record in result.skipped[: args.max_listed]:
        print(f"skipped: {record['where']}: {record['problem']}")
    if len(result.skipped) > args.max_listed:
        print(f"... and {len(result.skipped) - args.max_listed} more")
    splits = ", ".join(
        f"{name} {s['samples']} ({len(s['shards'])} shards)" for name, s in result.manifest["splits"].items()
    )
    skipped = f"; {len(result.skipped)} skipped, listed in {args.out / 'skipped.jsonl'}" if result.skipped else ""
    resumed = f"; {result.reused_shards} shards kept from an earlier run" if result.reused_shards else ""
    rate = result.samples_written / result.seconds if result.seconds else 0.0
    print(f"wrote {args.out}: {splits}{skipped}{resumed}; {result.seconds:.1f} s, {rate:.1f} samples/s")
    return 0


def _check_writable(out: Path, option: str) -> None:
    """Refuse, before anything is read or computed, an output directory that cannot be written: a
    file on its path, a read-only disk, no permission (OutputNotWritable, one line). Nothing is made:
    the nearest directory that exists is probed, so a command refused later leaves nothing behind."""
    from vldist.training.run_lock import check_writable

    check_writable(out, option, make=False)


def _write(args, run) -> int:
    """Run a command that writes a set: into --out, or, for a URL, into a local staging directory
    of its own (the same for the same URL: a conversion interrupted there resumes) whose shards are
    uploaded as each is finished, the manifest last once the set is whole (vldist/store/publish.py);
    the staging directory is then removed."""
    if not is_url(args.out):
        args.out = Path(args.out)
        _check_writable(args.out, "--out")
        return run(args)
    import hashlib
    import shutil

    from vldist.store.publish import upload_while_building

    url = args.out.rstrip("/")
    staging = (
        Path(args.stage or Path.home() / ".cache" / "vldist" / "staging")
        / hashlib.sha256(redact(url).encode()).hexdigest()[:16]
    )
    _check_writable(staging, "--stage")
    args.out, overwrite = staging, args.overwrite
    if args.command != "convert":  # a rendered set is built again whole; a conversion resumes in its staging
        args.overwrite = True
        shutil.rmtree(staging, ignore_errors=True)  # no shard of an earlier build may be uploaded as this one's
    with upload_while_building(staging, url, overwrite=overwrite) as publisher:
        code = run(args)
    if code == 0:
        sent = publisher.finish(staging)
        print(f"published {redact(url)}: {sent} files (manifest last)")
        shutil.rmtree(staging)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vldist.shards", description="Build shard sets.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_synth(sub)
    _add_synth_pairs(sub)
    _add_convert(sub)
    _add_verify(sub)
    _add_index(sub)
    args = parser.parse_args(argv)
    target = getattr(args, "out", None)  # _write replaces a URL with its staging directory
    runs = {"synth": _run_synth, "synth-pairs": _run_synth_pairs, "convert": _run_convert, "verify": _run_verify}
    try:
        if args.command in ("synth", "synth-pairs", "convert"):
            return _write(args, runs[args.command])
        if args.command == "verify":
            return _run_verify(args)
        if args.command == "index":
            return _run_index(args)
    except (
        FileExistsError,
        FileNotFoundError,
        OutputNotWritable,
        ValueError,
        RuntimeError,
        ConnectionError,
    ) as err:  # not bad data: arguments, store, an output that cannot be written
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # synth and synth-pairs (convert and index say what they kept themselves)
        print(
            f"\ninterrupted: nothing of {redact(str(target))} was kept (a set is written whole or not at all); "
            "the same command builds it again",
            file=sys.stderr,
        )
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
