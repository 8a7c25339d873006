"""Evaluate a checkpoint: `python -m vldist.evaluate <checkpoint or run dir> [--split test] [--shards DIR]`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from vldist.checkpoint.format import find_checkpoint
from vldist.checkpoint.object_store import local_checkpoint
from vldist.checkpoint.trained_model import load_checkpoint
from vldist.config import JobConfig
from vldist.exit_codes import DONE, REPORTED_ERRORS, exit_status
from vldist.recipes import get_recipe
from vldist.training.split_evaluation import eval_loader, evaluate_split


def evaluate_checkpoint(
    path, split: str = "test", shards: str | None = None, device: str = "auto"
) -> tuple[JobConfig, dict]:
    path = local_checkpoint(str(path))  # a store URL: downloaded into the local cache first
    config, recipe, model, shard_set = load_checkpoint(path, shards, device)
    recipe.preflight(shard_set)
    where = f"the {split} split of {shard_set.directory}"
    device = next(model.parameters()).device
    checkpoint = find_checkpoint(path)
    # in the run, not the checkpoint; an export (vldist.export) has no run around it
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint
    pictures = run / "images" / f"evaluate-{split}"
    return config, evaluate_split(
        recipe, model, eval_loader(config, recipe, shard_set, split), device, where, images_dir=pictures
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vldist.evaluate", description=__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its best checkpoint)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--shards", help="shard directory (default: the one the checkpoint was trained on)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", action="store_true", help="print the full metrics as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        config, metrics = evaluate_checkpoint(args.checkpoint, args.split, args.shards, args.device)
    except REPORTED_ERRORS as err:
        code, message = exit_status(err)
        print(message, file=sys.stderr)
        return code
    recipe = get_recipe(config.recipe)  # its report is a class method: no model or vocabulary needed
    print(
        f"{config.recipe} checkpoint {args.checkpoint} on {args.split}: {metrics['n_images']} {metrics.get('unit', 'images')}, "
        f"{metrics['n_captions']} captions"
    )
    print(recipe.report({"model": metrics}, args.split))
    if args.json:
        print(json.dumps(metrics, indent=2))
    return DONE


if __name__ == "__main__":
    sys.exit(main())
