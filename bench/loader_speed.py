"""The VSRN training loader alone, side by side with a plain WebDataset pipeline in open_clip's
style, in one process: samples/s and the time to the first batch, from local disk and (with
--remote) from an S3 store, cold and through data.cache_dir, and over HTTP.

    python bench/loader_speed.py [--shards shards/synth] [--batches 30] [--repeats 3] [--remote]
                                 [--epoch-start 2] [--json docs/results/loader_speed.json]

Both pipelines read the job's shards with its batch (data.batch_size 128), shuffle buffer (2000)
and per-sample work: the recipe's own train_sample (a caption drawn and tokenised, regions.npy
parsed) and collate_train. vldist's is the trainer's TrainingStreams (data/streams.py); the
plain one is wds.DataPipeline(ResampledShards, tarfile_to_samples, shuffle, map(train_sample),
batched) in a wds.WebLoader, reading the same tar members (select_files) so that the comparison is
of the pipelines, not of the bytes read. For each pipeline, source and worker count the first batch
is timed from the loader's creation (worker start and the shuffle buffer's first fill), then
--batches more batches; each line is the median (and the range) of --repeats passes, the two
pipelines' passes alternating. The plain pipeline reads local
files and HTTP (through curl, as WebDataset does); it has no S3 reader of its own.

--epoch-start PAUSE also times the first batch of an epoch after a whole one and a pause of PAUSE
seconds (the trainer validates there): with the loaders' workers kept, which begin the epoch as the
last one ends (data/streams.py), and with new workers at the epoch's start, as before they persisted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def _config(shards: str, workers: int, extra: list[str]):
    from vldist.recipes.jobs import load_config

    return load_config(
        "vsrn",
        [
            f"data.shards={shards}",
            f"data.workers={workers}",
            "metrics.enabled=false",
            f"output.dir={tempfile.mkdtemp(prefix='vldist-loader-bench-')}",
            *extra,
        ],
    )


def _recipe_and_shards(config):
    from vldist.data.job_shards import open_job_shards
    from vldist.recipes import get_recipe

    recipe_cls = get_recipe(config.recipe)
    shards = open_job_shards(config, recipe_cls)
    vocab = shards.main.vocab(config.output_dir, config.data.vocab_min_count)
    return recipe_cls(config, vocab, shards.main.feature_dim()), shards


def vldist_batches(config, batches: int):
    """The trainer's stream of one rank (TrainingStreams), cut after `batches` batches."""
    from vldist.data.streams import TrainingStreams

    recipe, shards = _recipe_and_shards(config)
    streams = TrainingStreams(config, recipe, shards, rank=0, world_size=1)
    return contextlib.closing(streams.batches(epoch=0)), batches


def webdataset_batches(config, batches: int):
    """A plain WebDataset pipeline over the same shards, with the recipe's sample and collate functions."""
    import webdataset as wds

    recipe, shards = _recipe_and_shards(config)
    sample_fn, collate_fn = recipe.stream_functions("train")
    wanted = tuple("." + key for key in recipe.sample_keys)
    rng = random.Random(config.seed)
    workers = config.data.workers
    pipeline = wds.DataPipeline(
        wds.ResampledShards(shards.main.urls("train")),
        wds.tarfile_to_samples(handler=wds.warn_and_continue, select_files=lambda name: name.endswith(wanted)),
        wds.shuffle(config.data.shuffle_buffer, initial=config.data.shuffle_buffer),
        wds.map(lambda raw: sample_fn(raw, rng)),  # decoded after the shuffle: only what is yielded
        wds.batched(config.data.batch_size, collation_fn=collate_fn, partial=False),
    ).with_epoch(-(-batches // max(workers, 1)))
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=workers)
    return contextlib.closing(iter(loader)), batches


def epoch_start(config, pause: float, kept: bool) -> float:
    """Seconds to the first batch of epoch 1, after the whole of epoch 0 and `pause` seconds."""
    from vldist.data.streams import TrainingStreams

    recipe, shards = _recipe_and_shards(config)
    streams = TrainingStreams(config, recipe, shards, rank=0, world_size=1)
    try:
        for _ in streams.batches(epoch=0):
            pass
        if not kept:
            streams.close()  # as before: the next epoch's workers start with it
        time.sleep(pause)
        start = time.perf_counter()
        with contextlib.closing(streams.batches(epoch=1)) as batches:
            next(batches)
            return time.perf_counter() - start
    finally:
        streams.close()


def one_pass(make, config, batches: int) -> tuple[float, float]:
    """(seconds to the first batch, samples/s over the next `batches`)."""
    start = time.perf_counter()
    stream, wanted = make(config, batches + 1)
    with stream as batches_iter:
        first = next(iter(batches_iter))
        size = len(first["identity"]) if "identity" in first else config.data.batch_size
        first_seconds = time.perf_counter() - start
        start, samples = time.perf_counter(), 0
        for _, _batch in zip(range(wanted - 1), batches_iter, strict=False):
            samples += size
        return first_seconds, samples / (time.perf_counter() - start)


def measure(name: str, make, config, batches: int, repeats: int) -> dict:
    return measure_alternating([(name, make, config)], batches, repeats)[0]


def measure_alternating(cases: list, batches: int, repeats: int) -> list[dict]:
    """One pass of each (name, make, config) case in turn, `repeats` rounds: on a shared, noisy
    machine a load that comes and goes then falls on every case alike; each row gives its median
    and the spread of its passes."""
    passes: dict[str, list] = {name: [] for name, _, _ in cases}
    for _ in range(repeats):
        for name, make, config in cases:
            passes[name].append(one_pass(make, config, batches))
    rows = []
    for name, _, _ in cases:
        rates = [p[1] for p in passes[name]]
        row = {
            "case": name,
            "first_batch_s": statistics.median(p[0] for p in passes[name]),
            "samples_per_s": statistics.median(rates),
            "samples_per_s_range": [min(rates), max(rates)],
            "passes": passes[name],
        }
        print(
            f"| {name} | {row['samples_per_s']:.0f} ({min(rates):.0f}-{max(rates):.0f}) | {row['first_batch_s']:.2f} |",
            flush=True,
        )
        rows.append(row)
    return rows


PIPELINES = (("vldist", vldist_batches), ("plain WebDataset", webdataset_batches))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=Path, default=REPO / "shards" / "synth")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--remote", action="store_true", help="also from S3 (cold, cached) and over HTTP")
    parser.add_argument("--epoch-start", type=float, metavar="PAUSE", help="also time an epoch's first batch")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    import torch

    from vldist.data.job_shards import build_missing
    from vldist.recipes import get_recipe

    shards = args.shards.resolve()
    build_missing(_config(str(shards), 0, []), get_recipe("vsrn"))
    rows = []
    print(
        f"VSRN training loader, data.batch_size 128, shuffle buffer 2000, {args.batches} batches after the first, "
        f"median of {args.repeats}; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    print("| pipeline, source, workers | samples/s (median, range) | first batch, s |\n|---|---|---|")
    for workers in args.workers:
        config = _config(str(shards), workers, [])
        cases = [(f"{name}, local disk, {workers} workers", make, config) for name, make in PIPELINES]
        rows += measure_alternating(cases, args.batches, args.repeats)
    if args.epoch_start is not None:
        for workers in [w for w in args.workers if w]:
            config = _config(str(shards), workers, ["train.epochs=2"])
            for round_ in range(args.repeats):  # alternating, so that the machine's load falls on both alike
                for kept in (True, False):
                    seconds = epoch_start(config, args.epoch_start, kept)
                    case = f"vldist, epoch 1's first batch after a {args.epoch_start:g} s pause, {workers} workers, "
                    case += "workers kept" if kept else "new workers"
                    rows.append({"case": case, "round": round_, "first_batch_s": seconds})
                    print(f"| {case} (round {round_ + 1}) | | {seconds:.2f} |", flush=True)
    if args.remote:
        from remote_shards import remote_copies

        with remote_copies(shards) as (store_env, http, s3, scratch):
            os.environ.update(store_env)  # as a cluster node has them: the job's configuration holds no secret
            workers = max(args.workers)
            cache = [f"data.cache_dir={scratch / 'cache'}"]
            cases = [
                ("vldist, HTTP", vldist_batches, http, []),
                ("plain WebDataset, HTTP (curl)", webdataset_batches, http, []),
                ("vldist, S3, no cache", vldist_batches, s3, []),
                ("vldist, S3, cache cold", vldist_batches, s3, cache),
                ("vldist, S3, cache warm", vldist_batches, s3, cache),
            ]
            for name, make, source, extra in cases:
                repeats = 1 if name.endswith("cache cold") else args.repeats  # one pass fills the cache
                rows.append(
                    measure(f"{name}, {workers} workers", make, _config(source, workers, extra), args.batches, repeats)
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"torch": torch.__version__, "cpus": os.cpu_count(), "batches": args.batches, "rows": rows}, indent=1
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
