"""Export a trained model: `python -m vldist.export RUN [--checkpoint best|latest|step-N] --out DIR [--force]`.

Writes the whole model's weights (model.safetensors, under today's parameter names), the job config
(config.yaml) and the vocabulary (vocab.json) of one checkpoint of RUN into DIR, with meta.json,
files.json and COMPLETE: DIR is itself a checkpoint of the model alone, which `python -m
vldist.evaluate DIR` and `python -m vldist.caption DIR ...` read, and plain `safetensors` code
loads (the README shows how). The checkpoint may have been written by either engine, on any number
of ranks; its checksums are checked before anything is written. An earlier export in DIR is
replaced only with --force, and a DIR that cannot be written is refused before anything is read.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml
from safetensors import SafetensorError

from vldist.checkpoint.format import (
    CHOICES,
    begin,
    chosen_name,
    commit,
    find_checkpoint,
    is_complete,
    load_model_state,
    read_config,
    read_meta,
    step_checkpoints,
    temporary_path,
    verify,
    write_files,
)
from vldist.checkpoint.object_store import local_checkpoint
from vldist.data.vocab import Vocab
from vldist.errors import CheckpointError, OutputNotWritable
from vldist.exit_codes import DONE, REPORTED_ERRORS, exit_status
from vldist.store.location import is_url
from vldist.training.run_lock import check_writable


def choose_checkpoint(run: Path, which: str | None) -> Path:
    """The checkpoint of `run` that `which` names (None: what evaluation takes, best else newest);
    `run` may also be a checkpoint directory itself."""
    run = Path(run)
    if which is None or is_complete(run):
        if which is not None:
            raise CheckpointError(
                f"'{run}' is a checkpoint itself; --checkpoint ({which}) chooses among a run's "
                "checkpoints: give the run directory, or leave --checkpoint out"
            )
        return find_checkpoint(run)
    directory = run / "checkpoints"
    steps = [p.name for p in step_checkpoints(directory)]
    best = is_complete(directory / "best")
    name = chosen_name(which, best, steps)
    if name is None:
        available = ", ".join(["best"] * best + steps) or "none"
        raise CheckpointError(
            f"--checkpoint {which}: no such complete checkpoint in {directory} (available: {available})"
        )
    return directory / name


def export(run: Path | str, out: Path, which: str | None = None, force: bool = False) -> Path:
    """Write the export of `run`'s chosen checkpoint to `out` (atomically: a killed export leaves no
    half-written DIR); an earlier export there is replaced only if `force`. Returns the checkpoint
    exported."""
    out = Path(out)
    if out.exists() and not is_complete(out) and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out} exists and is not an earlier export; name a new or empty directory")
    if is_complete(out) and not force:
        raise CheckpointError(
            f"--out {out} holds an earlier export ({_exported(out)}); add --force to replace it, or name a new directory"
        )
    # where the export is written beside and renamed into: refused before a checkpoint is read or downloaded
    check_writable(out.parent, "--out", str(out), make=False)
    if is_url(str(run)):  # a store: the chosen checkpoint downloaded into the local cache first
        run, which = local_checkpoint(str(run), None, which), None
    checkpoint = choose_checkpoint(run, which)
    verify(checkpoint)
    weights = load_model_state(checkpoint)  # whole, upgraded to today's names
    meta = read_meta(checkpoint)
    config = read_config(checkpoint)
    vocab = Vocab.load(checkpoint / "vocab.json")
    tmp = temporary_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # an empty directory given as --out: the commit renames the export into its place
        begin(out)
        write_files(
            tmp,
            model_state=weights,
            train_state=None,
            config_yaml=yaml.safe_dump(config, sort_keys=False),
            vocab=vocab,
            meta={
                **{k: v for k, v in meta.items() if k != "vldist_version"},
                "exported_from": str(checkpoint.resolve()),
            },
        )
        commit(tmp, out)
    except (OSError, SafetensorError) as err:  # a disk that fills up: safetensors raises its own error
        shutil.rmtree(tmp, ignore_errors=True)
        cause = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise OutputNotWritable(
            f"cannot write the export to --out {out}: {cause}. Nothing was written there; free space or "
            "choose another --out DIR"
        ) from None
    return checkpoint


def _exported(out: Path) -> str:
    """What an earlier export in `out` holds, for the refusal: its checkpoint and step."""
    try:
        meta = read_meta(out)
    except (CheckpointError, OSError, ValueError):
        return "unreadable meta.json"
    return f"{meta.get('exported_from', '?')}, step {meta.get('step', '?')}"


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vldist.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "run",
        help="a run directory (output.dir), or one checkpoint directory; or their store URL "
        "(output.checkpoint_dir, s3://...)",
    )
    parser.add_argument("--checkpoint", help=f"which of the run's checkpoints: {CHOICES} (default: best, else latest)")
    parser.add_argument(
        "--out", required=True, help="the directory to write: new or empty (an earlier export: with --force)"
    )
    parser.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    args = parser.parse_args(argv)
    try:
        checkpoint = export(args.run, Path(args.out), args.checkpoint, args.force)
    except REPORTED_ERRORS as err:
        code, message = exit_status(err)
        print(message, file=sys.stderr)
        return code
    meta = read_meta(Path(args.out))
    size = (Path(args.out) / "model.safetensors").stat().st_size
    print(
        f"exported {checkpoint} ({meta.get('recipe')}, step {meta.get('step')}, written by "
        f"{_ranks(meta.get('world_size', 1))} under {meta.get('engine', 'accelerate')}) to {args.out}: "
        f"model.safetensors ({size / 2**20:.1f} MiB), config.yaml, vocab.json"
    )
    return DONE


if __name__ == "__main__":
    sys.exit(main())
