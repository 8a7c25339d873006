"""Evaluate a checkpoint: `python -m vldist.evaluate <checkpoint or run dir> [--split test] [--shards DIR]`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from vldist.checkpoint import CheckpointError, find_checkpoint, load_model_state
from vldist.config import ConfigError, JobConfig, job_config_class, read_yaml, validate
from vldist.data.shardset import ShardSet, ShardsNotFoundError
from vldist.data.vocab import Vocab
from vldist.distributed.engine import pick_device
from vldist.recipes import get_recipe
from vldist.report import chance_recall, retrieval_table


def evaluate_checkpoint(path, split: str = "test", shards: str | None = None, device: str = "auto") -> tuple[JobConfig, dict]:
    from vldist.trainer import eval_loader

    ckpt = find_checkpoint(path)
    raw = read_yaml(ckpt / "config.yaml")
    if shards:
        raw["data"]["shards"] = shards
    recipe_cls = get_recipe(raw["recipe"])
    config = validate(raw, job_config_class(recipe_cls.ModelConfig))
    shard_set = ShardSet.open(config.data.shards)
    recipe = recipe_cls(config, Vocab.load(ckpt / "vocab.json"), shard_set.feature_dim())
    torch_device = pick_device(device)
    model = recipe.build_model()
    model.load_state_dict(load_model_state(ckpt))
    model.to(torch_device)
    return config, recipe.evaluate(model, eval_loader(config, recipe, shard_set, split), torch_device)


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
    except (CheckpointError, ConfigError, ShardsNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    recipe = get_recipe(config.recipe)(config, vocab=None)
    cpi = config.model.captions_per_image
    print(f"{config.recipe} checkpoint {args.checkpoint} on {args.split}: {metrics['n_images']} images")
    print(retrieval_table({"chance": chance_recall(metrics["n_images"], cpi), "model": recipe.headline(metrics)}))
    if "1k_5fold" in metrics:
        print("1K five-fold:\n" + retrieval_table({"model": metrics["1k_5fold"]}))
    if args.json:
        print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
