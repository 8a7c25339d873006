"""Runs a converter: shards in parallel, resumable, deterministic, with a manifest at the end.

Shard i of a split always holds items [i*shard_size, (i+1)*shard_size) of the plan (less any that
were skipped), so each shard can be written by any worker, at any time, and comes out the same.
A finished shard is recorded in `<out>/.convert/done/`; a rerun with the same arguments finds the
same plan (its fingerprint is stored in `.convert/plan.json`), checks each recorded shard's
sha256 and writes only the rest. Half-written shards are `.tmp` files and are discarded, so no
sample is ever written twice. The manifest is written last and `.convert/` then removed.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import queue as queue_module
import shutil
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from vldist.data.vocab import Vocab
from vldist.file_integrity import sha256_file, write_json_atomic
from vldist.shards.convert.base import BadInput, Converter, Item, Plan, Problems, SampleMaker, skip_record
from vldist.shards.convert.formats import FORMATS
from vldist.shards.format.layout import MANIFEST_NAME, STANDARDIZATION_NAME, VOCAB_NAME
from vldist.shards.format.standardization import save_standardization, standardization_in
from vldist.shards.format.writer import ShardFile, build_manifest, check_split, sample_members

STATE_DIR = ".convert"
SKIPPED_NAME = "skipped.jsonl"
ITEMS_PER_CALL = 32  # items handed to the sample maker at once (feature extraction batches them)
_SET_FILES = (
    MANIFEST_NAME,
    VOCAB_NAME,
    SKIPPED_NAME,
    MANIFEST_NAME + ".tmp",
    STANDARDIZATION_NAME,
    STANDARDIZATION_NAME + ".tmp",
)


@dataclass
class ShardTask:
    split: str
    index: int
    items: list[Item]

    @property
    def record_name(self) -> str:
        return f"{self.split}-{self.index:06d}.json"


@dataclass
class Result:
    manifest: dict
    skipped: list[dict] = field(default_factory=list)
    reused_shards: int = 0  # shards found finished by an earlier, interrupted run
    samples_written: int = 0
    seconds: float = 0.0
    already_done: bool = False


def convert(
    converter: type[Converter],
    args,
    out: str | Path,
    shard_size: int = 1000,
    workers: int = 1,
    on_error: str = "stop",
    progress: bool = True,
    overwrite: bool = False,
) -> Result:
    start = time.perf_counter()
    if shard_size < 1:
        raise ValueError(f"--shard-size must be at least 1, got {shard_size}")
    out = Path(out)
    problems = Problems(on_error)
    plan = converter.plan(args, problems)
    options = converter.options(args)
    tasks = _tasks(plan.splits, shard_size)
    fingerprint = _fingerprint(converter, options, shard_size, plan)

    finished = _prepare_out(out, fingerprint, overwrite)
    if finished is not None:
        return Result(finished, already_done=True, seconds=time.perf_counter() - start)

    state = out / STATE_DIR
    done = _finished_records(state, out, tasks)
    todo = [t for t in tasks if t.record_name not in done]
    total = sum(len(t.items) for t in tasks)
    bar = tqdm(
        total=total,
        initial=total - sum(len(t.items) for t in todo),
        unit="sample",
        desc=f"convert {converter.name}",
        disable=not progress,
    )
    try:
        if todo:
            setup = plan.prepare()
            stats = standardization_in(setup)
            if plan.features and stats is not None:  # written before any shard: a resumed run finds it
                save_standardization(out, *stats)
            for record_name, record in _run(converter, setup, todo, out, on_error, workers, bar.update):
                write_json_atomic(state / "done" / record_name, record)
                done[record_name] = record
    finally:
        bar.close()

    records = [done[t.record_name] for t in tasks]
    skipped = plan.skipped + [s for r in records for s in r["skipped"]]
    manifest = _finish(out, converter, options, plan, tasks, records, skipped, fingerprint)
    return Result(
        manifest,
        skipped,
        reused_shards=len(tasks) - len(todo),
        samples_written=sum(r["samples"] for r in records),
        seconds=time.perf_counter() - start,
    )


# ---------------------------------------------------------------------------------- the plan


def _tasks(splits: dict[str, list[Item]], shard_size: int) -> list[ShardTask]:
    seen: dict[str, str] = {}
    tasks = []
    for split, items in splits.items():
        check_split(split)
        for item in items:
            if item.key in seen:  # converters build keys from their plan order, so this is a bug
                raise RuntimeError(f"converter produced key {item.key!r} twice ({seen[item.key]}, {item.where})")
            seen[item.key] = item.where
        for index, start in enumerate(range(0, len(items), shard_size)):
            tasks.append(ShardTask(split, index, items[start : start + shard_size]))
    if not tasks:
        raise BadInput("the source", "holds no samples to convert (see the skipped list, or check --src)")
    return tasks


def _fingerprint(converter: type[Converter], options: dict, shard_size: int, plan: Plan) -> str:
    digest = hashlib.sha256()
    head = [converter.name, converter.version, options, shard_size, plan.features, plan.inputs]
    digest.update(json.dumps(head, sort_keys=True).encode())
    for items in plan.splits.values():
        for item in items:
            digest.update(json.dumps(item.as_json(), sort_keys=True).encode())
    return digest.hexdigest()


# ----------------------------------------------------------------------- the output directory


def _is_set_file(path: Path) -> bool:
    name = path.name
    if name == STATE_DIR or name in _SET_FILES:
        return True
    stem = name.removesuffix(".tmp").removesuffix(".idx.json")  # a shard, or its sample index
    split, _, index = stem.removesuffix(".tar").rpartition("-")
    return stem.endswith(".tar") and bool(split) and index.isdigit() and len(index) == 6


def _prepare_out(out: Path, fingerprint: str, overwrite: bool) -> dict | None:
    """Make `out` ready for this conversion; returns its manifest when it already holds exactly
    this conversion's result."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is not a directory; choose another --out")
    entries = sorted(out.iterdir()) if out.exists() else []
    foreign = [p.name for p in entries if not _is_set_file(p)]
    if foreign:
        raise FileExistsError(
            f"--out {out} holds files that are not part of a shard set ({', '.join(foreign[:5])}); "
            "it is left alone even with --overwrite: choose another --out or empty it yourself"
        )
    state = out / STATE_DIR
    plan_file = state / "plan.json"
    if entries and not overwrite:
        if plan_file.is_file():
            if json.loads(plan_file.read_text()).get("fingerprint") == fingerprint:
                _discard_partial_shards(out)
                return None  # resume
            if any((state / "done").glob("*.json")):
                raise FileExistsError(
                    f"--out {out} holds an unfinished conversion of other input or options; rerun the "
                    "command that started it to resume, or pass --overwrite to start again"
                )
        elif (out / MANIFEST_NAME).is_file():
            manifest = json.loads((out / MANIFEST_NAME).read_text())
            if manifest.get("conversion", {}).get("fingerprint") == fingerprint:
                return manifest
            raise FileExistsError(
                f"--out {out} already holds a shard set made from other input or options; "
                "pass --overwrite to replace it, or choose another --out"
            )
        else:
            raise FileExistsError(
                f"--out {out} holds shards without a manifest or a conversion record; "
                "pass --overwrite to replace them, or choose another --out"
            )
    for path in entries:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (state / "done").mkdir(parents=True, exist_ok=True)
    write_json_atomic(plan_file, {"fingerprint": fingerprint})
    return None


def finished_shard_count(out: Path) -> int:
    """Shards an unfinished conversion into `out` has finished (what a rerun keeps)."""
    done = Path(out) / STATE_DIR / "done"
    return len(list(done.glob("*.json"))) if done.is_dir() else 0


def _discard_partial_shards(out: Path) -> None:
    for path in out.glob("*.tar.tmp"):
        path.unlink()


def _finished_records(state: Path, out: Path, tasks: list[ShardTask]) -> dict[str, dict]:
    """Records of shards an earlier run finished whose file is still intact."""
    records = {}
    for task in tasks:
        path = state / "done" / task.record_name
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        shard = out / record["file"] if record["file"] else None
        if shard is None or (shard.is_file() and sha256_file(shard) == record["sha256"]):
            records[task.record_name] = record
    return records


# ----------------------------------------------------------------------------- the writing


def write_shard(task: ShardTask, out: Path, make: SampleMaker, on_error: str, tick) -> dict:
    """Write one shard from its items; under `skip` bad items are left out and listed."""
    shard = ShardFile(out, task.split, task.index)
    skipped = []
    try:
        for start in range(0, len(task.items), ITEMS_PER_CALL):
            items = task.items[start : start + ITEMS_PER_CALL]
            results = make(items)
            if len(results) != len(items):
                raise RuntimeError(f"sample maker returned {len(results)} results for {len(items)} items")
            for item, sample in zip(items, results, strict=True):
                if isinstance(sample, BadInput):
                    if on_error == "stop":
                        raise sample
                    skipped.append(skip_record(item.key, item.split, sample))
                    continue
                shard.add(*sample_members({"__key__": item.key, **sample}))
            tick(len(items))
    except BaseException:
        shard.abandon()
        raise
    if shard.samples == 0:  # every item skipped: no empty tar
        shard.abandon()
        return {"file": None, "samples": 0, "sha256": None, "skipped": skipped}
    return {**shard.finish(), "skipped": skipped}


def _run(converter, setup, todo: list[ShardTask], out: Path, on_error: str, workers: int, tick):
    """Yields (record name, record) as shards finish; raises the first BadInput under `stop`
    after the shards already running have finished (so a rerun does not redo them)."""
    if workers <= 1 or len(todo) == 1:
        make = converter.worker(setup)
        for task in todo:
            yield task.record_name, write_shard(task, out, make, on_error, tick)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold torch threads
    ticks = context.Queue()
    failure: BaseException | None = None
    with ProcessPoolExecutor(
        min(workers, len(todo)), mp_context=context, initializer=_init_worker, initargs=(converter.name, setup, ticks)
    ) as pool:
        futures = {pool.submit(_run_task, task, out, on_error): task for task in todo}
        pending = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(ticks, tick)
                for future in finished:
                    if future.cancelled():
                        continue
                    error = future.exception()
                    if error is not None:
                        failure = failure or error
                        for other in pending:
                            other.cancel()
                        continue
                    yield futures[future].record_name, future.result()
        except BaseException:
            for other in pending:
                other.cancel()
            raise
    _drain(ticks, tick)
    if failure is not None:
        raise failure


def _drain(ticks, tick) -> None:
    while True:
        try:
            tick(ticks.get_nowait())
        except queue_module.Empty:
            return


_WORKER: dict = {}


def _init_worker(name: str, setup, ticks) -> None:
    _WORKER["make"] = FORMATS[name].worker(setup)
    _WORKER["ticks"] = ticks


def _run_task(task: ShardTask, out: Path, on_error: str) -> dict:
    return write_shard(task, out, _WORKER["make"], on_error, _WORKER["ticks"].put)


# ------------------------------------------------------------------------------ the ending


def _finish(
    out: Path,
    converter,
    options: dict,
    plan: Plan,
    tasks: list[ShardTask],
    records: list[dict],
    skipped: list[dict],
    fingerprint: str,
) -> dict:
    skipped_keys = {s["key"] for s in skipped}
    train = [
        c
        for t in tasks
        if t.split == "train"
        for item in t.items
        if item.key not in skipped_keys
        for c in item.captions
    ]
    if train:
        Vocab.build(train).save(out / VOCAB_NAME)
    (out / SKIPPED_NAME).unlink(missing_ok=True)
    if skipped:
        with open(out / SKIPPED_NAME, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in skipped)
    shards: dict[str, list[dict]] = {}
    for task, record in zip(tasks, records, strict=True):
        listed = shards.setdefault(task.split, [])
        if record["file"]:
            listed.append({k: record[k] for k in ("file", "samples", "sha256", "caption_words") if k in record})
    extra = {
        "conversion": {
            "converter": converter.name,
            "converter_version": converter.version,
            "options": options,
            "inputs": plan.inputs,
            "fingerprint": fingerprint,
            "skipped": dict(Counter(s["split"] or "unplaced" for s in skipped)),
        },
    }
    if plan.features:
        # named here, not in plan.features: the plan's fingerprint stays what it was
        stored = (out / STANDARDIZATION_NAME).is_file()
        extra["features"] = {**plan.features, **({"standardization": STANDARDIZATION_NAME} if stored else {})}
    manifest = build_manifest(converter.name, shards, extra)
    write_json_atomic(out / MANIFEST_NAME, manifest)
    shutil.rmtree(out / STATE_DIR)
    return manifest
