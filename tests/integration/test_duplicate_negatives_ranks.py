"""A planted copy in a 2-rank global batch (one copy on each rank, and both on one rank): every
objective's loss and gradients equal the test's loops with the copy removed from the candidates,
and W = 2 ranks equal 1 process. The loops are those of tests/unit/test_duplicate_negatives.py."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import duplicate_negatives as worker  # noqa: E402
from helpers import run_on_two_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_duplicate_negatives import (  # noqa: E402
    cross_entropy_without_copies,
    hinge_without_copies,
)
from test_two_branch_loss import direct_loss  # noqa: E402  (Eq. 3-6 loop by loop, copies left out by identity)

from vldist.losses.damsm import cosine_matrix, word_region_scores  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("duplicates") / "two.pt"
    run_on_two_ranks(Path(worker.__file__), out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_process() -> dict:
    return worker.run(0, 1)


def reference(objective: str, inputs: dict) -> tuple[torch.Tensor, dict]:
    """The loss with each copy left out of the candidates, written as loops, and its leaves."""
    identity = inputs["identity"]
    if objective.startswith("hinge"):
        leaves = {k: inputs[k].clone().requires_grad_() for k in ("image", "text")}
        return hinge_without_copies(leaves["image"], leaves["text"], identity, 0.2, objective == "hinge"), leaves
    if objective == "two_branch":
        leaves = {k: inputs[k].clone().requires_grad_() for k in ("image", "sentences")}
        text_image = torch.arange(worker.B).repeat_interleave(2)
        return direct_loss(
            leaves["image"], leaves["sentences"], text_image, 0.1, 3, 1.0, 2.0, 0.2, identity=identity
        ), leaves
    leaves = {k: inputs[k].clone().requires_grad_() for k in ("words", "regions", "sentence", "global_image")}
    part = objective[len("damsm_") :]
    if part.startswith("words"):
        logits = 10.0 * word_region_scores(leaves["words"], worker.LENGTHS, leaves["regions"], 4.0, 5.0)
    else:
        logits = 10.0 * cosine_matrix(leaves["sentence"], leaves["global_image"])
    return cross_entropy_without_copies(logits if part.endswith("t2i") else logits.T, identity), leaves


@pytest.mark.parametrize("placement", list(worker.PLACEMENTS))
@pytest.mark.parametrize("objective", worker.OBJECTIVES)
def test_loss_and_gradients_leave_the_copy_out_on_two_ranks(two_ranks, one_process, placement, objective):
    ref, leaves = reference(objective, worker.global_inputs(placement))
    ref.backward()
    two, one = two_ranks[placement, objective], one_process[placement, objective]
    tolerance = 1e-6 if objective == "two_branch" else 1e-10  # its distances carry sqrt(d^2 + 1e-8)
    assert two["loss"] == pytest.approx(ref.item(), rel=tolerance)
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-12)
    for name, leaf in leaves.items():
        expected = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad  # a part that does not use it
        assert torch.allclose(two["grads"][name], expected, atol=tolerance), name
        assert torch.allclose(one["grads"][name], two["grads"][name], atol=1e-12), name


@pytest.mark.parametrize("placement", list(worker.PLACEMENTS))
def test_drawn_negatives_skip_the_copy_and_match_one_process(two_ranks, one_process, placement):
    draw = two_ranks[placement, "draw"]
    assert torch.equal(draw, one_process[placement, "draw"])
    caption_identity = torch.tensor(worker.PLACEMENTS[placement]).repeat_interleave(2)
    assert not (caption_identity[draw] == caption_identity[None, :]).any()
    for t in range(draw.shape[1]):  # every caption of another image can be drawn; none of its own image
        assert set(draw[:, t].tolist()) <= {
            k for k in range(len(caption_identity)) if caption_identity[k] != caption_identity[t]
        }
