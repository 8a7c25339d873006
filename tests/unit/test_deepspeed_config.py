"""The DeepSpeed config a job produces: ZeRO settings from the file, everything else from the job."""

import json

import pytest

from vldist.distributed.deepspeed_config import deepspeed_config
from vldist.errors import ConfigError
from vldist.recipes.jobs import load_config


def _job(*overrides):
    return load_config("vsrn", ["engine.backend=deepspeed", *overrides])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_files_set_their_stage_and_the_job_sets_the_rest(stage):
    job = _job(
        f"engine.deepspeed_config=jobs/deepspeed/zero{stage}.json",
        "data.batch_size=128",
        "train.grad_accumulation=2",
        "train.grad_clip=2.0",
    )
    ds = deepspeed_config(job, world_size=2, on_cuda=False)
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["train_batch_size"] == 128
    assert ds["train_micro_batch_size_per_gpu"] * 2 * ds["gradient_accumulation_steps"] == 128
    assert ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 2.0
    assert ds["torch_autocast"]["enabled"] is False  # CPU trains in fp32


def test_mixed_precision_is_autocast_on_cuda_only():
    job = _job("engine.mixed_precision=bf16")
    assert deepspeed_config(job, 1, on_cuda=True)["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert deepspeed_config(job, 1, on_cuda=False)["torch_autocast"]["enabled"] is False


def test_a_file_setting_what_the_job_owns_is_refused_by_name(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "train_batch_size": 64}))
    with pytest.raises(ConfigError) as err:
        deepspeed_config(_job(f"engine.deepspeed_config={path}"), 1, on_cuda=False)
    assert "'gradient_clipping' (set train.grad_clip in the job instead)" in str(err.value)
    assert "'train_batch_size' (set data.batch_size" in str(err.value)


def test_a_missing_or_broken_file_names_itself(tmp_path):
    with pytest.raises(ConfigError, match=r"no file 'zero9.json'.*jobs/deepspeed/zero2.json"):
        deepspeed_config(_job("engine.deepspeed_config=zero9.json"), 1, on_cuda=False)
    broken = tmp_path / "broken.json"
    broken.write_text("{stage: 2")
    with pytest.raises(ConfigError, match="not valid JSON"):
        deepspeed_config(_job(f"engine.deepspeed_config={broken}"), 1, on_cuda=False)
