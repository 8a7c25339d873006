"""Every built-in recipe's job, every stage, a few optimizer steps on each engine, in one torchrun
launch: `every_recipe_in_step.py OUT ENGINE PLANTED SYNTH PAIRS SINGLES SCENES [JOB,JOB..] [KEY=VALUE,..]`
(some jobs only; overrides for each of them).

Each stage runs as `python -m vldist.train` runs it (vldist.train.run_stages, training/on_each_rank.py, the
trainer, the replica check after the first update), in one process group kept from run to run.
After each stage every rank saves its replicated state (all but BatchNorm2d's statistics) to OUT/<job>.<stage>.rank<R>.pt for the test
to compare; the evaluations are left out (their speed is not what is under test).
"""

import logging
import sys
from pathlib import Path

import torch
import yaml

import vldist.train
import vldist.training.on_each_rank
from vldist.recipes.jobs import load_config
from vldist.training import loop

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for its helpers
from helpers import TINY_LAVITER_MODEL  # noqa: E402

out, engine = Path(sys.argv[1]), sys.argv[2]
planted, synth, pairs, singles, scenes = sys.argv[3:8]

TINY_CAPTIONER = [
    "model.hidden=32",
    "model.embed=16",
    "data.batch_size=8",
    "data.eval_batch_size=8",
    "data.shuffle_buffer=16",
    "data.max_regions=3",
    "data.vocab_min_count=1",
]
JOBS = {
    "vsrn": [
        f"data.shards={planted}",
        "model.embed_size=32",
        "model.decoder_hidden=32",
        "model.word_dim=16",
        "data.batch_size=8",
        "data.shuffle_buffer=16",
    ],
    "captioner": [f"data.shards={planted}", *TINY_CAPTIONER],
    # the MLE stage runs model.captioner_job: a job file of the same sizes, written below
    "cl_caption": [
        f"data.shards={planted}",
        *TINY_CAPTIONER,
        "model.replace_reference_every=1",
        f"model.captioner_job={out / 'tiny_captioner.yaml'}",
    ],
    "two_branch_embed": [
        f"data.shards={synth}",
        "model.hidden=32",
        "model.embed=16",
        "data.batch_size=8",
        "data.shuffle_buffer=16",
        "model.tasks=[retrieval]",
    ],
    "two_branch_sim": [
        f"data.shards={synth}",
        "model.hidden=32",
        "model.embed=16",
        "data.batch_size=8",
        "data.shuffle_buffer=16",
        "model.tasks=[retrieval]",
    ],
    "l2c": [
        f"data.shards={pairs}",
        f"model.single_shards={singles}",
        "model.hidden=32",
        "model.embed=16",
        "data.batch_size=4",
        "data.shuffle_buffer=16",
    ],
    "laviter": [
        f"data.shards={scenes}",
        "model.pretrain_epochs=1",
        "model.vta_epochs=1",
        "model.assist_epochs=1",
        "model.joint_epochs=1",
        *TINY_LAVITER_MODEL,
        "data.batch_size=4",
        "data.shuffle_buffer=16",
    ],
}
ENGINE = {"accelerate": [], "zero2": ["engine.backend=deepspeed", "engine.deepspeed_config=jobs/deepspeed/zero2.json"]}
COMMON = [
    "train.max_steps=2",
    "eval.baseline=false",
    "eval.meteor=false",  # its JVM's ~6 s start: the captions' metrics are not what this compares
    "train.validate_every=0",
    "metrics.enabled=false",
    "train.replica_check_every=1",
    "engine.sync_batchnorm=true",
]  # buffers replicated too

fit = loop.Trainer.fit


def fit_then_save(self):
    self.evaluate = lambda split: None
    results = fit(self)
    model = self.engine.unwrap()
    # per-rank by design: image batch norm's running statistics (vldist's global batch norm is 1-d)
    local = {
        f"{name}.{stat}"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.BatchNorm2d)
        for stat in ("running_mean", "running_var", "num_batches_tracked")
    }
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in local}
    torch.save(state, out / f"{self.config.recipe}.{self.config.output_dir.name}.rank{self.engine.rank}.pt")
    return results


logging.basicConfig(level=logging.INFO, format="%(message)s")
loop.Trainer.fit = fit_then_save
(out / "tiny_captioner.yaml").write_text(
    yaml.safe_dump(
        {
            "recipe": "captioner",
            "model": {"hidden": 32, "embed": 16},
            "data": {
                "batch_size": 8,
                "eval_batch_size": 8,
                "shuffle_buffer": 16,
                "max_regions": 3,
                "vocab_min_count": 1,
            },
            "train": {"max_steps": 2, "validate_every": 1},
            "eval": {"baseline": False, "meteor": False},
        }
    )
)  # validated (by nobody: see fit_then_save), so a best is kept
run = vldist.training.on_each_rank.run
# one process group for every run (run_stages imports on_each_rank.run when it is called)
vldist.training.on_each_rank.run = lambda stage, **_: run(stage, last=False)

jobs = sys.argv[8].split(",") if len(sys.argv) > 8 else list(JOBS)
extra = sys.argv[9].split(",") if len(sys.argv) > 9 else []  # more overrides for every job
for job in jobs:
    overrides = [*JOBS[job], *COMMON, *ENGINE[engine], *extra, f"output.dir={out / 'runs' / job}"]
    if job == "laviter" and engine == "zero2":  # DeepSpeed drives one optimizer: the GAN's phases need two
        overrides += ["model.tim=false"]
    vldist.train.run_stages(load_config(job, overrides))
    print(f"{job} on {engine}: done", flush=True)
torch.distributed.destroy_process_group()
