"""DAMSM on W = 2 gloo ranks (DDP) takes the same steps as one process on the whole batch: each
rank's captions meet every rank's images and its images every rank's captions, the shares sum to
the one-process loss (each of the four terms too), and the gradients and weights after each SGD
step match. Splits 4 + 4, 5 + 3 and 8 + 0; the ranks pad their words to different widths."""

import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import damsm_step as worker  # noqa: E402
from engines import cpu_engine  # noqa: E402
from helpers import run_on_two_ranks  # noqa: E402

from vldist.losses.damsm import PARTS  # noqa: E402
from vldist.shards.convert.images import one_thread  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("damsm") / "two.pt"
    run_on_two_ranks(Path(worker.__file__), out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_process() -> dict:
    with one_thread():  # as each torchrun rank (OMP_NUM_THREADS=1): the same float sums
        return worker.run(cpu_engine(), "even")


def test_the_ranks_pad_to_different_widths(two_ranks):
    widths = two_ranks["widths"]
    assert widths[0]["even"] < widths[1]["even"] and widths[0]["uneven"] > widths[1]["uneven"]


@pytest.mark.parametrize("split", list(worker.SPLITS))
def test_two_ranks_take_the_steps_of_one_process(two_ranks, one_process, split):
    two, one = two_ranks["results"][split], one_process
    assert two["world_size"] == 2 and one["world_size"] == 1
    losses = [s["losses"]["loss"] for s in one["steps"]]
    assert losses[0] > 1.0 and all(b < a - 0.1 for a, b in pairwise(losses))  # each step lowered it
    for step, (got, expected) in enumerate(zip(two["steps"], one["steps"], strict=True)):
        for name in ("loss", *PARTS):
            assert got["losses"][name] == pytest.approx(expected["losses"][name], rel=1e-5), (step, name)
        assert sum(got["losses"][name] for name in PARTS) == pytest.approx(got["losses"]["loss"], rel=1e-6)
        assert got["grads"].keys() == expected["grads"].keys() and len(expected["grads"]) == 8
        scale = max(float(g.abs().max()) for g in expected["grads"].values())
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-5 * scale, msg=f"{step} {name}")
        for name, value in expected["state"].items():
            torch.testing.assert_close(
                got["state"][name].float(),
                value.float(),
                rtol=1e-4,
                atol=worker.LR * 1e-5 * scale * (step + 1) + 1e-5,
                msg=f"{step} {name}",
            )
