"""cl_caption on W = 2 gloo ranks (DDP) takes the same steps as one process on the whole batch.

Each rank holds half the images (3 + 3, and 2 + 4) with their captions; negatives are drawn from
every rank's captions. Three SGD steps, dropout 0: the loss, every gradient and the weights after
each step must agree (a rank dividing by its own caption count instead of the global one, negatives
from the local slice only, or image ids that collide across ranks all break this). Step 0 starts
from target = reference and step 2 replaces the reference by the target through DDP's wrapper:
both give G = 0 everywhere, so the loss is exactly 2 ln 2; step 1 is the one with a non-trivial loss.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import cl_caption_step as worker  # noqa: E402
from engines import cpu_engine  # noqa: E402
from helpers import run_on_two_ranks  # noqa: E402

from vldist.shards.convert.images import one_thread  # noqa: E402


@pytest.fixture(scope="module")
def captioner(tmp_path_factory) -> Path:
    return worker.write_captioner(tmp_path_factory.mktemp("cl_equivalence") / "captioner")


@pytest.fixture(scope="module")
def two_ranks(captioner, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cl_equivalence") / "two.pt"
    run_on_two_ranks(Path(worker.__file__), captioner, out, timeout=240)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def one_process(captioner) -> dict:
    with one_thread():  # as each torchrun rank (OMP_NUM_THREADS=1): the same float sums
        return worker.run(cpu_engine(), worker.make_recipe(captioner), "even")


@pytest.mark.parametrize("split", list(worker.SPLITS))
def test_two_ranks_take_the_steps_of_one_process(two_ranks, one_process, split):
    two = two_ranks[split]
    assert two["world_size"] == 2 and one_process["world_size"] == 1
    for step, (got, expected) in enumerate(zip(two["steps"], one_process["steps"], strict=True)):
        for key, value in expected["losses"].items():
            # g_pos, g_neg: differences of float32 log-probabilities of size ~10 (ulp ~1e-6)
            assert got["losses"][key] == pytest.approx(value, rel=1e-6, abs=1e-6), (step, key)
        assert got["grads"].keys() == expected["grads"].keys()
        assert all(name.startswith("target.") for name in expected["grads"])  # the reference gets none
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=f"{step} {name}")
        for name, value in expected["state"].items():
            gap = float((got["state"][name] - value).abs().max())
            assert gap <= 1e-6, (step, name, gap)
    losses = [s["losses"] for s in one_process["steps"]]
    assert losses[0]["loss"] == pytest.approx(2 * math.log(2), abs=1e-6)  # target = reference at the start
    assert abs(losses[1]["loss"] - 2 * math.log(2)) > 1e-3 and abs(losses[1]["g_pos"]) > 1e-3
    assert losses[2]["loss"] == pytest.approx(2 * math.log(2), abs=1e-6)  # replaced before step 2's forward


def test_the_steps_move_the_target_and_the_reference_only_at_the_replacement(one_process):
    states = [s["state"] for s in one_process["steps"]]
    target = [n for n in states[0] if n.startswith("target.")]
    reference = {n: n.replace("target.", "reference.", 1) for n in target}
    moved = sum(float((states[1][n] - states[0][n]).abs().max()) > 1e-4 for n in target)
    assert moved > len(target) // 2
    for n, r in reference.items():
        assert torch.equal(states[0][r], states[1][r])  # frozen through steps 0 and 1
        assert torch.equal(states[2][r], states[1][n])  # step 2 copied the target as step 1 left it
