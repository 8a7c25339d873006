"""Contrastive-captioning loss (Dai & Lin 2017, Eq. 7-10) against the paper's formula in python
floats, its gradients, the frozen reference, and its clear errors."""

import math

import pytest
import torch

from vldist.losses import contrastive_captioning_loss, cross_rank_contrastive_captioning_loss


def log_probs(k, t, seed, dtype=torch.float64):
    """Sentence log-probabilities of T positives and K x T negatives; G = target − reference in ~[-6, 6]."""
    g = torch.Generator().manual_seed(seed)
    pos_reference = -5 - 20 * torch.rand(t, generator=g, dtype=dtype)
    neg_reference = -5 - 20 * torch.rand(k, t, generator=g, dtype=dtype)
    pos_target = pos_reference + 2 * torch.randn(t, generator=g, dtype=dtype)
    neg_target = neg_reference + 2 * torch.randn(k, t, generator=g, dtype=dtype)
    return pos_target, pos_reference, neg_target, neg_reference


def paper_loss(pos_target, pos_reference, neg_target, neg_reference, nu, terms):
    """−J of Eq. 10 written out with h = r_ν(G) = 1 / (1 + ν exp(−G)) (Eq. 3, 7, 8): X copied K times."""

    def r_nu(g):
        return 1 / (1 + nu * math.exp(-g))

    k_sets, t_pos = len(neg_target), len(pos_target)
    total = 0.0
    for k in range(k_sets):
        objective = 0.0  # L(θ; X, Y_k, φ), Eq. 9
        if terms in ("full", "positive"):
            objective += sum(math.log(r_nu(pos_target[t] - pos_reference[t])) for t in range(t_pos))
        if terms in ("full", "negative"):
            objective += sum(math.log(1 - r_nu(neg_target[k][t] - neg_reference[k][t])) for t in range(t_pos))
        total += objective
    return -total / (k_sets * t_pos)


@pytest.mark.parametrize("terms", ["full", "positive", "negative"])
@pytest.mark.parametrize("nu", [1.0, 0.3, 4.0])
@pytest.mark.parametrize("k,t", [(1, 1), (1, 6), (5, 1), (5, 7), (3, 20)])
def test_matches_the_paper_formula(k, t, nu, terms):
    inputs = log_probs(k, t, seed=k * 100 + t)
    loss = contrastive_captioning_loss(*inputs, nu=nu, terms=terms)
    expected = paper_loss(*(x.tolist() for x in inputs), nu=nu, terms=terms)
    assert loss.dim() == 0 and loss.dtype == torch.float64
    assert float(loss) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # float32 inputs (the training dtype) give a float32 loss close to it
    loss32 = contrastive_captioning_loss(*(x.float() for x in inputs), nu=nu, terms=terms)
    assert loss32.dtype == torch.float32
    assert float(loss32) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_known_values_and_decomposition():
    """G = 0, ν = 1: h = 1/2 everywhere, so −J = 2 ln 2 (full) and ln 2 for each half."""
    zeros_pos, zeros_neg = torch.zeros(4), torch.zeros(5, 4)
    assert float(contrastive_captioning_loss(zeros_pos, zeros_pos, zeros_neg, zeros_neg)) == pytest.approx(
        2 * math.log(2)
    )
    for terms in ("positive", "negative"):
        assert float(
            contrastive_captioning_loss(zeros_pos, zeros_pos, zeros_neg, zeros_neg, terms=terms)
        ) == pytest.approx(math.log(2))
    inputs = log_probs(3, 5, seed=9)
    parts = [contrastive_captioning_loss(*inputs, nu=2.0, terms=terms) for terms in ("positive", "negative")]
    torch.testing.assert_close(parts[0] + parts[1], contrastive_captioning_loss(*inputs, nu=2.0))


def test_positive_only_may_skip_the_negatives():
    """CL(P) needs no negative forward pass: K = 0 gives the same value as any K."""
    pos_target, pos_reference, neg_target, neg_reference = log_probs(3, 5, seed=2)
    empty = torch.zeros(0, 5, dtype=torch.float64)
    torch.testing.assert_close(
        contrastive_captioning_loss(pos_target, pos_reference, empty, empty, terms="positive"),
        contrastive_captioning_loss(pos_target, pos_reference, neg_target, neg_reference, terms="positive"),
    )


def test_extreme_log_ratios_stay_finite_and_keep_their_gradient():
    """|G| = 300: exp overflows the naive form and the official clip(h, 1e-20) floors ln h at −46
    with zero gradient; the logsigmoid form gives ln h ≈ G and gradient −1/T for the positive."""
    pos_target = torch.tensor([-400.0, 0.0], requires_grad=True)  # G = −300 (mistaken), +100 (easy)
    neg_target = torch.tensor([[200.0, -400.0]], requires_grad=True)  # G = +300 (mistaken), −300 (easy)
    reference = torch.tensor([-100.0, -100.0])
    loss = contrastive_captioning_loss(pos_target, reference, neg_target, reference[None])
    assert loss.item() == pytest.approx((300 + 300) / 2, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(pos_target.grad, torch.tensor([-0.5, 0.0]))
    torch.testing.assert_close(neg_target.grad, torch.tensor([[0.5, 0.0]]))


@pytest.mark.parametrize("terms", ["full", "positive", "negative"])
@pytest.mark.parametrize("nu", [1.0, 0.5])
def test_gradcheck(terms, nu):
    pos_target, pos_reference, neg_target, neg_reference = log_probs(3, 4, seed=5)
    inputs = (pos_target.requires_grad_(), neg_target.requires_grad_())
    assert torch.autograd.gradcheck(
        lambda p, n: contrastive_captioning_loss(p, pos_reference, n, neg_reference, nu=nu, terms=terms), inputs
    )
    assert torch.autograd.gradgradcheck(
        lambda p, n: contrastive_captioning_loss(p, pos_reference, n, neg_reference, nu=nu, terms=terms), inputs
    )


def test_gradient_signs():
    """Raising a positive's target log-probability lowers the loss; raising a negative's raises it."""
    pos_target, pos_reference, neg_target, neg_reference = log_probs(4, 6, seed=3)
    pos_target.requires_grad_()
    neg_target.requires_grad_()
    loss = contrastive_captioning_loss(pos_target, pos_reference, neg_target, neg_reference, nu=1.5)
    loss.backward()
    assert (pos_target.grad < 0).all() and (neg_target.grad > 0).all()
    with torch.no_grad():
        for t in range(6):
            up = pos_target.clone()
            up[t] += 0.1
            assert contrastive_captioning_loss(up, pos_reference, neg_target, neg_reference, nu=1.5) < loss
            up = neg_target.clone()
            up[t % 4, t] += 0.1
            assert contrastive_captioning_loss(pos_target, pos_reference, up, neg_reference, nu=1.5) > loss


def test_the_reference_gets_no_gradient():
    pos_target, pos_reference, neg_target, neg_reference = log_probs(2, 3, seed=4)
    pos_target.requires_grad_()
    neg_target.requires_grad_()
    contrastive_captioning_loss(pos_target, pos_reference, neg_target, neg_reference).backward()
    assert not pos_reference.requires_grad and not neg_reference.requires_grad
    assert pos_reference.grad is None and neg_reference.grad is None
    # A reference scored with gradient on (say a reference model left trainable) is still frozen.
    pos_reference.requires_grad_()
    neg_reference.requires_grad_()
    contrastive_captioning_loss(pos_target, pos_reference, neg_target, neg_reference).backward()
    assert pos_reference.grad is None and neg_reference.grad is None
    assert pos_target.grad is not None and neg_target.grad is not None


def test_half_precision_is_computed_in_float32():
    inputs = log_probs(2, 3, seed=6, dtype=torch.float32)
    loss = contrastive_captioning_loss(*(x.bfloat16() for x in inputs))
    assert loss.dtype == torch.float32
    expected = paper_loss(*(x.bfloat16().double().tolist() for x in inputs), nu=1.0, terms="full")
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_cross_rank_share_is_the_loss_in_one_process():
    inputs = log_probs(5, 7, seed=8)
    for terms in ("full", "positive", "negative"):
        torch.testing.assert_close(
            cross_rank_contrastive_captioning_loss(*inputs, nu=0.5, terms=terms),
            contrastive_captioning_loss(*inputs, nu=0.5, terms=terms),
        )


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: {**a, "pos_reference": a["pos_reference"][:-1]}, "shape \\(T,\\)"),
        (lambda a: {**a, "pos_target": a["pos_target"][None]}, "shape \\(T,\\)"),
        (
            lambda a: {**a, "neg_target": a["neg_target"][:, :-1], "neg_reference": a["neg_reference"][:, :-1]},
            "shape \\(K, T\\)",
        ),
        (lambda a: {**a, "neg_reference": a["neg_reference"][0]}, "shape \\(K, T\\)"),
        (lambda a: {**a, "neg_target": a["neg_target"][:0], "neg_reference": a["neg_reference"][:0]}, "K >= 1"),
        (lambda a: {k: v[..., :0] for k, v in a.items()}, "T >= 1"),
        (lambda a: {**a, "nu": 0.0}, "nu"),
        (lambda a: {**a, "nu": float("nan")}, "nu"),
        (lambda a: {**a, "terms": "both"}, "terms"),
    ],
)
def test_clear_errors(change, message):
    names = ("pos_target", "pos_reference", "neg_target", "neg_reference")
    args = change(dict(zip(names, log_probs(2, 3, seed=1), strict=True)))
    with pytest.raises(ValueError, match=message):
        contrastive_captioning_loss(**args)


def test_integer_inputs_are_rejected():
    pos, neg = torch.zeros(3, dtype=torch.long), torch.zeros(2, 3)
    with pytest.raises(TypeError, match="pos_target"):
        contrastive_captioning_loss(pos, pos.float(), neg, neg)
