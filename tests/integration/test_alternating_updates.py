"""Two optimizers stepped alternately, with a frozen module, on 2 ranks through the real trainer.

What LAViTeR's GAN (alternating updates, phases) and CL (a frozen reference model) need from the
engine; the recipe is a test-only VSRN variant (workers/alternating_updates.py).
"""

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

WORKER = Path(__file__).parent / "workers" / "alternating_updates.py"
JOB = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    "data.batch_size=32",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    "train.max_steps=3",
    "train.save_every_steps=1",
    "train.keep_last=3",
    "train.log_every=1",
    "train.validate_every=0",
    "eval.baseline=false",
    "engine.sync_batchnorm=true",
]


def _changed(a: dict, b: dict, prefixes: tuple[str, ...]) -> set[str]:
    """Parameters that differ (BatchNorm running statistics move with every forward)."""
    return {k for k in a if k.startswith(prefixes) and ".bn." not in k and not torch.equal(a[k], b[k])}


def test_alternating_optimizers_update_only_their_parameters_and_frozen_ones_never(planted_shards, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        f"data.shards={planted_shards}",
        f"output.dir={tmp_path}",
        *JOB,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = tmp_path / "checkpoints"
    w1, w2, w3 = (load_file(ckpt / f"step-{s:08d}" / "model.safetensors") for s in (1, 2, 3))
    image, text = ("image.",), ("text.", "decoder.")

    # step 2 updates the text side only, step 3 the image side only
    assert _changed(w1, w2, image) == set() and len(_changed(w1, w2, text)) > 3
    assert _changed(w2, w3, text) == set() and len(_changed(w2, w3, image)) > 3
    # the frozen word embeddings never move and are no optimizer's business
    assert torch.equal(w1["text.embed.weight"], w3["text.embed.weight"])
    state = torch.load(ckpt / "step-00000003" / "optimizer.pt", weights_only=True)
    assert set(state["optimizers"]) == {"image", "text"}
    text_params = [k for k in w3 if k.startswith(text) and k != "text.embed.weight"]
    assert sum(len(g["params"]) for g in state["optimizers"]["text"]["param_groups"]) == len(text_params)
    assert "image/loss" in proc.stderr and "text/loss" in proc.stderr  # each update logs its own loss
