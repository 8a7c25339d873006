"""The DeepSpeed config of a job: a ZeRO file from jobs/deepspeed/ plus what the job already says.

The file holds what is DeepSpeed's own business (ZeRO stage, buckets, overlap). Batch sizes,
accumulation, clipping, precision, optimizer and schedule come from the job config, so that one job
file means the same optimisation under either engine; a file that sets them is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

from vldist.config import PACKAGE_DIR
from vldist.distributed.precision import effective_precision
from vldist.errors import ConfigError

# DeepSpeed keys the job config owns, and the job key to use instead.
OWNED_KEYS = {
    "train_batch_size": "data.batch_size",
    "train_micro_batch_size_per_gpu": "data.batch_size and train.grad_accumulation",
    "gradient_accumulation_steps": "train.grad_accumulation",
    "gradient_clipping": "train.grad_clip",
    "fp16": "engine.mixed_precision",
    "bf16": "engine.mixed_precision",
    "torch_autocast": "engine.mixed_precision",
    "optimizer": "train.optimizer and train.lr",
    "scheduler": "train.lr_schedule",
}


def find_deepspeed_file(name: str) -> Path:
    """A path as given (from the working directory), else a file shipped with vldist ('jobs/deepspeed/...')."""
    candidates = [Path(name), PACKAGE_DIR / name]
    for path in candidates:
        if path.is_file():
            return path
    shipped = sorted(str(p.relative_to(PACKAGE_DIR)) for p in (PACKAGE_DIR / "jobs" / "deepspeed").glob("*.json"))
    raise ConfigError(
        f"engine.deepspeed_config: no file '{name}' (looked in . and {PACKAGE_DIR}). Shipped: {', '.join(shipped)}"
    )


def deepspeed_precision(job, on_cuda: bool) -> str:
    """engine.mixed_precision as DeepSpeed's torch_autocast runs it: resolved on CUDA; fp32 on CPU."""
    return effective_precision(job.engine.mixed_precision, "cuda") if on_cuda else "no"


def deepspeed_config(job, world_size: int, on_cuda: bool) -> dict:
    path = find_deepspeed_file(job.engine.deepspeed_config)
    try:
        base = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"engine.deepspeed_config: {path} is not valid JSON ({err})") from None
    clashes = [f"'{k}' (set {OWNED_KEYS[k]} in the job instead)" for k in base if k in OWNED_KEYS]
    if clashes:
        raise ConfigError(f"engine.deepspeed_config: {path} sets {', '.join(clashes)}")
    accumulation = job.train.grad_accumulation
    precision = deepspeed_precision(job, on_cuda)
    return {
        **base,
        "train_batch_size": job.data.batch_size,
        "train_micro_batch_size_per_gpu": job.data.batch_size // (world_size * accumulation),
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": job.train.grad_clip or 0.0,
        # fp32 weights and optimizer, autocast compute: what the Accelerate engine does too
        "torch_autocast": {"enabled": precision != "no", "dtype": "bfloat16" if precision == "bf16" else "float16"},
        "zero_allow_untested_optimizer": True,  # vldist passes its own torch optimizer
        "steps_per_print": base.get("steps_per_print", 10**9),  # vldist prints progress itself
    }
