"""A trained model from a checkpoint (or a run directory's best one), ready to evaluate or caption."""

from __future__ import annotations

from vldist.checkpoint.format import check_checkpoint_fits_job, find_checkpoint, load_model_state, read_config
from vldist.checkpoint.object_store import local_checkpoint
from vldist.data.embedded_home import read_location
from vldist.data.shardset import ShardSet
from vldist.data.vocab import Vocab
from vldist.distributed.engine import pick_device
from vldist.errors import CheckpointError
from vldist.recipes import get_recipe
from vldist.recipes.jobs import validate_job
from vldist.store.access import StoreAccess


def load_checkpoint(path, shards: str | None = None, device: str = "auto"):
    """(config, recipe, model on the device, shard set) of a checkpoint or a run directory (its
    best checkpoint); `shards` replaces the shard directory the checkpoint was trained on."""
    ckpt = find_checkpoint(local_checkpoint(str(path)))  # a store URL: downloaded into the local cache first
    raw = read_config(ckpt)  # keys an older vldist wrote are upgraded
    if shards:
        raw["data"] = {**raw.get("data", {}), "shards": shards}
    config = validate_job(raw)
    recipe_cls = get_recipe(config.recipe)
    shard_set = ShardSet.open(
        read_location(config.data.shards, config.data.build_if_missing), StoreAccess.of(config.data)
    )
    try:
        vocab = Vocab.load(ckpt / "vocab.json")
    except ValueError as err:
        raise CheckpointError(f"{err} (the checkpoint's vocabulary: the checkpoint is damaged)") from None
    recipe = recipe_cls(config, vocab, shard_set.feature_dim())
    check_checkpoint_fits_job(
        ckpt, recipe.build_model, config.model_dump(mode="json"), recipe.feature_dim, len(recipe.vocab), "evaluate"
    )
    model = recipe.build_model()
    model.load_state_dict(load_model_state(ckpt))
    model.to(pick_device(device)).eval()
    return config, recipe, model, shard_set
