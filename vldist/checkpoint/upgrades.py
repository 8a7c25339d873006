"""Does a checkpoint fit the job that loads it? And upgrades of checkpoints from older vldist.

Checkpoints record the vldist version that wrote them (`vldist_version` in meta.json; checkpoints
without one are from 0.1). Loading one from an older version first renames what has been renamed
since (parameters in RENAMED_PARAMETERS, config keys in MOVED_CONFIG_KEYS), so it loads as if
written today. A checkpoint that still does not fit the model the job builds is refused with the
reason (the config keys that differ from the checkpoint's config.yaml, another vocabulary or
feature width) instead of PyTorch's list of size mismatches.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from vldist import __version__
from vldist.errors import IncompatibleCheckpoint

OLDEST = "0.1.0"  # checkpoints without a recorded version

# (version that renamed it, recipe, old key prefix, new key prefix)
RENAMED_PARAMETERS = [
    ("0.2.0", "vsrn", "image.fc.", "image.region_projection."),  # W_f of Eq. 1, named for what it does
]
# (version that moved it, old dotted key, new dotted key); a new key of None: dropped
MOVED_CONFIG_KEYS = [
    # was the exact caption count evaluation demanded; now a cap, and any count per image is evaluated
    ("0.2.0", "model.captions_per_image", "eval.max_captions_per_image"),
]


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(part) for part in (text or OLDEST).split(".")[:3] if part.isdigit())


def written_before(meta: dict, version: str) -> bool:
    return _version(meta.get("vldist_version")) < _version(version)


def upgrade_parameter_names(names, meta: dict) -> dict[str, str]:
    """{name in the checkpoint: name today} for the parameters renamed since it was written."""
    recipe = meta.get("recipe")
    renames = [(old, new) for since, r, old, new in RENAMED_PARAMETERS if r == recipe and written_before(meta, since)]
    mapping = {}
    for name in names:
        today = name
        for old, new in renames:
            if today.startswith(old):
                today = new + today[len(old) :]
        mapping[name] = today
    return mapping


def upgrade_state(state: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    mapping = upgrade_parameter_names(state, meta)
    return {mapping[name]: tensor for name, tensor in state.items()}


def upgrade_config(raw: dict, meta: dict) -> dict:
    """A checkpoint's config.yaml (as a dict) with the keys moved since it was written."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for since, old, new in MOVED_CONFIG_KEYS:
        section, key = old.split(".")
        if not written_before(meta, since) or key not in raw.get(section, {}):
            continue
        value = raw[section].pop(key)
        if new is not None:
            new_section, new_key = new.split(".")
            raw.setdefault(new_section, {}).setdefault(new_key, value)
    return raw


def stamp(meta: dict) -> dict:
    return {**meta, "vldist_version": __version__}


def checkpoint_shapes(path) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a model.safetensors, read from its header alone."""
    with safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def expected_shapes(build) -> dict[str, tuple[int, ...]]:
    """Shapes of the model `build()` makes, built on the meta device: no memory, no work."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return {name: tuple(t.shape) for name, t in build().state_dict().items()}


def check_parameter_shapes(
    checkpoint,
    expected: dict,
    saved: dict,
    meta: dict,
    checkpoint_config: dict,
    job: dict,
    feature_dim: int | None,
    vocab_size: int | None,
    action: str,
) -> None:
    """Raise IncompatibleCheckpoint unless the (upgraded) parameter shapes `saved` are the ones the
    job's model has (`expected`). The message lists what differs: model config keys, the feature
    width of the shards, the vocabulary size, or else the first mismatched parameters."""
    mismatched = sorted(n for n in expected.keys() & saved.keys() if expected[n] != saved[n])
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    if not (mismatched or missing or unexpected):
        return
    reasons = []
    ck_model, job_model = checkpoint_config.get("model", {}), job.get("model", {})
    for key in sorted(ck_model.keys() | job_model.keys()):
        if ck_model.get(key) != job_model.get(key):
            reasons.append(f"model.{key}: checkpoint {ck_model.get(key)!r}, this job {job_model.get(key)!r}")
    ck_shards, job_shards = checkpoint_config.get("data", {}).get("shards"), job.get("data", {}).get("shards")
    if meta.get("feature_dim") is not None and feature_dim is not None and meta["feature_dim"] != feature_dim:
        reasons.append(
            f"region feature width: checkpoint {meta['feature_dim']} (trained on {ck_shards}), "
            f"this job's shards {feature_dim} ({job_shards})"
        )
    if meta.get("vocab_size") is not None and vocab_size is not None and meta["vocab_size"] != vocab_size:
        reasons.append(
            f"vocabulary: checkpoint {meta['vocab_size']} words, this job {vocab_size} "
            f"(the vocab.json of {job_shards} differs from that of {ck_shards})"
        )
    if not reasons:  # an older checkpoint without feature_dim/vocab_size, or a change in the code
        reasons += [f"{n}: checkpoint {list(saved[n])}, this job's model {list(expected[n])}" for n in mismatched[:3]]
        if missing or unexpected:
            reasons.append(
                f"{len(missing)} parameters missing from the checkpoint (e.g. {(missing or ['-'])[0]}), "
                f"{len(unexpected)} it has that the model lacks (e.g. {(unexpected or ['-'])[0]})"
            )
    raise IncompatibleCheckpoint(
        f"cannot {action} {checkpoint}: it holds another model than this job builds:\n  "
        + "\n  ".join(reasons)
        + "\nUse the settings and shards the checkpoint was trained with (its config.yaml), or start a new "
        "run in another output.dir."
    )
