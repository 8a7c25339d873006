"""`python -m vldist.train --help` loads only what it prints: the recipe classes (their descriptions,
the job's config keys), none of the training platform (training/, engines, Ray, checkpoints)
and not torchvision, which the recipes import where they build a torchvision model."""

import json
import subprocess
import sys

import pytest

from vldist.recipes import BUILT_IN, get_recipe
from vldist.train import usage

# The help text as the command prints it, and every module it imported.
WRAPPER = """
import contextlib, io, json, runpy, sys
sys.argv = ["vldist.train", "--help"]
out, code = io.StringIO(), None
with contextlib.redirect_stdout(out):
    try:
        runpy.run_module("vldist.train", run_name="__main__", alter_sys=True)
    except SystemExit as end:
        code = end.code
print(json.dumps({"code": code, "help": out.getvalue(), "modules": sorted(sys.modules)}))
"""
# What training loads and --help must not; torch.distributed is not here: `import torch` loads it
# itself (checked below against a bare `import torch`), and the default job's recipe needs torch.
HEAVY = [
    "torchvision",
    "torch._dynamo",
    "sympy",
    "deepspeed",
    "accelerate",
    "ray",
    "prometheus_client",
    "vldist.training.loop",
    "vldist.training.on_each_rank",
    "vldist.checkpoint.format",
    "vldist.checkpoint.manager",
    "vldist.exit_codes",
    "vldist.launch.ray_train",
    "vldist.launch.resubmission",
    "vldist.telemetry",
    "vldist.distributed.engine",
]


def python(*args: str) -> dict:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def helped() -> dict:
    return python("-c", WRAPPER)


def test_help_leaves_the_training_platform_unloaded(helped):
    assert helped["code"] in (None, 0)
    loaded = set(helped["modules"])
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    bare = set(python("-c", "import json, sys, torch; print(json.dumps(sorted(sys.modules)))"))
    distributed = {m for m in loaded if m.startswith("torch.distributed")}
    assert distributed <= bare, sorted(distributed - bare)  # only what `import torch` brings itself


def test_help_lists_recipes_job_files_and_keys_as_the_classes_say(helped):
    assert helped["help"] == usage("vsrn") + "\n"
    lines = helped["help"].splitlines()
    for name in BUILT_IN:
        assert f"  {name:<18}{get_recipe(name).description}" in lines
    listed = next(line for line in lines if line.startswith("job files"))
    assert {"vsrn", "l2c", "captioner"} <= set(listed.split(": ", 1)[1].split(", "))
    assert any(line.startswith("  model.rrr_layers = 4") for line in lines)  # the job's keys, with values
    assert any(line.startswith("  train.epochs = ") for line in lines)
