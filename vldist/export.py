"""Export a trained model: `python -m vldist.export RUN [--checkpoint best|latest|step-N] --out DIR`.

Writes the whole model's weights (model.safetensors, under today's parameter names), the job config
(config.yaml) and the vocabulary (vocab.json) of one checkpoint of RUN into DIR, with meta.json,
files.json and COMPLETE: DIR is itself a checkpoint of the model alone, which `python -m
vldist.evaluate DIR` and `python -m vldist.caption DIR ...` read, and plain `safetensors` code
loads (the README shows how). The checkpoint may have been written by either engine, on any number
of ranks; its checksums are checked before anything is written.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

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
    verify,
    write_files,
)
from vldist.checkpoint.object_store import local_checkpoint
from vldist.data.vocab import Vocab
from vldist.errors import CheckpointError
from vldist.exit_codes import DONE, REPORTED_ERRORS, exit_status
from vldist.store.location import is_url


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


def export(run: Path | str, out: Path, which: str | None = None) -> Path:
    """Write the export of `run`'s chosen checkpoint to `out` (atomically: a killed export leaves no
    half-written DIR); returns the checkpoint exported."""
    if is_url(str(run)):  # a store: the chosen checkpoint downloaded into the local cache first
        run, which = local_checkpoint(str(run), None, which), None
    checkpoint = choose_checkpoint(run, which)
    out = Path(out)
    if out.exists() and not is_complete(out) and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out} exists and is not an earlier export; name a new or empty directory")
    verify(checkpoint)
    weights = load_model_state(checkpoint)  # whole, upgraded to today's names
    meta = read_meta(checkpoint)
    config = read_config(checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # an empty directory given as --out: the commit renames the export into its place
    tmp = begin(out)
    write_files(
        tmp,
        model_state=weights,
        train_state=None,
        config_yaml=yaml.safe_dump(config, sort_keys=False),
        vocab=Vocab.load(checkpoint / "vocab.json"),
        meta={**{k: v for k, v in meta.items() if k != "vldist_version"}, "exported_from": str(checkpoint.resolve())},
    )
    try:
        commit(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return checkpoint


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
    parser.add_argument("--out", required=True, help="the directory to write (new, empty, or an earlier export)")
    args = parser.parse_args(argv)
    try:
        checkpoint = export(args.run, Path(args.out), args.checkpoint)
    except REPORTED_ERRORS as err:
        code, message = exit_status(err)
        print(message, file=sys.stderr)
        return code
    meta = read_meta(Path(args.out))
    size = (Path(args.out) / "model.safetensors").stat().st_size
    print(
        f"exported {checkpoint} ({meta.get('recipe')}, step {meta.get('step')}, written by "
        f"{meta.get('world_size', 1)} ranks under {meta.get('engine', 'accelerate')}) to {args.out}: "
        f"model.safetensors ({size / 2**20:.1f} MiB), config.yaml, vocab.json"
    )
    return DONE


if __name__ == "__main__":
    sys.exit(main())
