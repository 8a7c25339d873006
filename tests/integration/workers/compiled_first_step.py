"""Each built-in recipe's first training step (every stage of its job), eager and under
train.compile: `compiled_first_step.py OUT BACKEND MODE=JOB,JOB[;MODE=JOB...] PLANTED SYNTH PAIRS
SINGLES SCENES [KEY=VALUE ...]` (e.g. `model=vsrn,laviter;step=vsrn`; the overrides after the sets
go to every run, e.g. `train.device=cuda`).

Run in one process or under torchrun (2 gloo ranks, cross-rank negatives). Each stage runs as
`python -m vldist.train` builds it (run_stages, on_each_rank.run, the Trainer); instead of
training, the trainer's first micro-batch goes through the loop's own loss call and the engine's
backward, and every rank saves that step's losses and every parameter's gradient to
OUT/<job>.<stage>.<eager|MODE>.rank<R>.pt for the test to compare. Each job runs eager first; a
stage that a later one starts from (CL's captioner, L2C's baseline, LAViTeR's phases) is then
trained its one step for real, so that the next stage finds its checkpoint. Then, for each MODE
that names the job, only the job's last stage runs again, compiled, in the same directory, from
the checkpoints the stages before it left: the last stage of each job is that recipe's training
step.
"""

import logging
import shutil
import sys
from contextlib import closing
from pathlib import Path

import torch
import yaml

import vldist.train
import vldist.training.on_each_rank
from vldist.data.device_prefetch import to_device
from vldist.recipes import get_recipe
from vldist.recipes.jobs import load_config
from vldist.training import loop
from vldist.training.evaluations import Evaluations

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for its helpers
from helpers import TINY_LAVITER_MODEL  # noqa: E402

out, backend = Path(sys.argv[1]), sys.argv[2]
modes = {mode: jobs.split(",") for mode, jobs in (part.split("=") for part in sys.argv[3].split(";"))}
planted, synth, pairs, singles, scenes = sys.argv[4:9]
extra = sys.argv[9:]
# Compiled, the caption decoders unroll their loop over data.max_caption_len (captions padded to
# it), and tracing that loop was most of VSRN's and the captioners' time at the default 32: 6 on the
# planted sets, whose captions are 5 tokens (3 words, <start>, <end>), so that compiled batches are
# still padded (VSRN's compile on one process: 27.6 s at 8, 24.1 s at 6).
PLANTED_CAPTION_LEN = 6
# L2C's and LAViTeR's jobs take 20 (descriptions of up to 18 words): 10 truncates the longer ones
# alike in eager and compiled steps and halves the loops traced (L2C's compile: 45 s at 20)
SHORT_CAPTION_LEN = 10
# the sizes of every_recipe_in_step.py (the replica check of every recipe), without dropout where a
# job has it, so that eager and compiled draw no random numbers the comparison depends on
TINY_CAPTIONER = {
    "model": {"hidden": 32, "embed": 16, "dropout": 0.0},
    "data": {"batch_size": 8, "eval_batch_size": 8, "shuffle_buffer": 16, "max_regions": 3, "vocab_min_count": 1},
    "train": {"max_steps": 1, "validate_every": 1},  # validated: CL starts from its best
    "eval": {"baseline": False},
}
TINY_CAPTIONER["data"]["max_caption_len"] = PLANTED_CAPTION_LEN
SMALL = ["model.hidden=32", "model.embed=16", "data.batch_size=8", "data.shuffle_buffer=16", "model.dropout=0"]
JOBS = {
    "vsrn": [
        f"data.shards={planted}",
        "model.embed_size=16",
        "model.decoder_hidden=16",
        "model.word_dim=8",
        "model.rrr_layers=1",
        "model.decoder_dropout=0",
        "data.batch_size=8",
        "data.shuffle_buffer=16",
        f"data.max_caption_len={PLANTED_CAPTION_LEN}",
    ],
    "captioner": [
        f"data.shards={planted}",
        *SMALL,
        "data.max_regions=3",
        "data.vocab_min_count=1",
        f"data.max_caption_len={PLANTED_CAPTION_LEN}",
    ],
    "cl_caption": [
        f"data.shards={planted}",
        *SMALL,
        "data.max_regions=3",
        "data.vocab_min_count=1",
        f"data.max_caption_len={PLANTED_CAPTION_LEN}",
        f"model.captioner_job={out / 'tiny_captioner.yaml'}",
    ],
    "two_branch_embed": [f"data.shards={synth}", *SMALL, "model.tasks=[retrieval]"],
    "two_branch_sim": [f"data.shards={synth}", *SMALL, "model.tasks=[retrieval]"],
    "l2c": [
        f"data.shards={pairs}",
        f"model.single_shards={singles}",
        *SMALL[:2],
        "model.dropout=0",
        "data.batch_size=4",
        f"data.max_caption_len={SHORT_CAPTION_LEN}",
    ],
    "laviter": [
        f"data.shards={scenes}",
        # phase 1, then phase 3 (every module) from it: the phases before the compiled one only
        # leave a checkpoint (the chain of all four: test_laviter_train.py), and two fewer save
        # 10 s a process
        "model.pretrain_epochs=0",
        "model.vta_epochs=1",
        "model.assist_epochs=0",
        "model.joint_epochs=1",
        *TINY_LAVITER_MODEL,
        "model.itm_dropout=0",
        "data.batch_size=4",
        "data.shuffle_buffer=16",
        f"data.max_caption_len={SHORT_CAPTION_LEN}",
    ],
}
# fp32 on every host: the tolerances are fp32's (L2C's job autocasts bf16 on a CPU with AMX)
COMMON = [
    "eval.baseline=false",
    "train.validate_every=0",
    "metrics.enabled=false",
    "train.replica_check_every=0",
    "engine.mixed_precision=no",
    *extra,
]
CUDA_GRAPH_CALLS = 3
fit = loop.Trainer.fit
stage_is_last, tag = True, "eager"


def first_step_then_fit(self):
    """Save the first micro-batch's losses and gradients, then train (a stage others start from)."""
    engine, recipe = self.engine, self.recipe
    recipe.start_epoch(0)
    self.model.train()
    with closing(self.streams.batches(0)) as batches:
        batch = next(iter(batches))
    batch.pop("skipped", None), batch.pop("skip_reasons", None), batch.pop("skipped_by_shard", None)
    batch = to_device(batch, engine.device)
    recipe.start_step(0)
    update = recipe.updates(0)[0]
    without_dropout(engine.unwrap())
    # Under CUDA graphs a compiled function's first call runs eager (warm-up), the second records
    # the graph and the third replays it: the step compared is the third, from the same random state
    devices = [engine.device] if engine.device.type == "cuda" else []
    for _ in range(CUDA_GRAPH_CALLS if self.compiler.cuda_graphs else 1):
        self.model.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        with torch.random.fork_rng(devices=devices), engine.micro_batch(last=True):
            losses = self.compiler.training_losses(self.model, batch, update)
            engine.backward(losses["loss"], 1)
    grads = {n: p.grad.detach().clone() for n, p in engine.unwrap().named_parameters() if p.grad is not None}
    name = f"{self.config.recipe}.{self.config.output_dir.name}.{tag}.rank{engine.rank}.pt"
    torch.save({"losses": {k: v.detach() for k, v in losses.items()}, "grads": grads, "update": update}, out / name)
    self.model.zero_grad(set_to_none=True)
    return None if stage_is_last else fit(self)


def without_dropout(model: torch.nn.Module) -> None:
    """Dropout's masks come from another random stream in compiled graphs than in eager kernels,
    so the comparison runs without it (also where a job has no setting for it: LAViTeR's E_T)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        elif isinstance(module, torch.nn.MultiheadAttention):
            module.dropout = 0.0


logging.basicConfig(level=logging.INFO, format="%(message)s")
loop.Trainer.fit = first_step_then_fit
# Left out of a stage others start from (trained for real): the test split's evaluation after it
# (its checkpoint is what they read), and the one-batch contract check before it (for captioning
# stages, Java's caption metrics), which every other training run in the suite makes; no step
# compared here depends on either
Evaluations.results = lambda self, state, started, train_seconds: {}
Evaluations.check_contract = lambda self: None
(out / "tiny_captioner.yaml").write_text(yaml.safe_dump({"recipe": "captioner", **TINY_CAPTIONER}))
run = vldist.training.on_each_rank.run


def run_keeping_the_group(stage, last=True, **_):
    global stage_is_last
    stage_is_last = last
    if not last and tag != "eager":  # it ran eager before, in this directory: its checkpoints are there
        return None
    return run(stage, last=False)  # one process group for every run


vldist.training.on_each_rank.run = run_keeping_the_group


def last_stage_dir(config) -> Path:
    stages = get_recipe(config.recipe).stages(config)
    return config.output_dir / stages[-1][0] if len(stages) > 1 else config.output_dir


for job in dict.fromkeys(job for jobs in modes.values() for job in jobs):
    for tag in ["eager", *(mode for mode, jobs in modes.items() if job in jobs)]:
        compiled = [f"train.compile={tag}", f"train.compile_backend={backend}"] if tag != "eager" else []
        config = load_config(job, [*JOBS[job], *COMMON, "train.max_steps=1", *compiled, f"output.dir={out / job}"])
        if tag != "eager" and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            shutil.rmtree(last_stage_dir(config))  # run again, compiled; the stages before it finished
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        vldist.train.run_stages(config)
        print(f"{job} {tag}: done", flush=True)
torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
