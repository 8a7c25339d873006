"""Contrastive Learning for image captioning (Dai & Lin, NIPS 2017, §4.2, Eq. 7-10).

A target captioner p_m is trained against a frozen reference p_n on sentence log-probabilities:

* G(c, I) = ln p_m(c | I) − ln p_n(c | I)                      (Eq. 7)
* h(c, I) = r_ν(G) = 1 / (1 + ν exp(−G)) = sigmoid(G − ln ν)   (Eq. 8, Eq. 3)
* L(X, Y) = Σ_t ln h(c_t, I_t) + Σ_t ln[1 − h(c_/t, I_t)]      (Eq. 9)
* J = (1/K)(1/T) Σ_k L(X, Y_k)                                  (Eq. 10), maximised

X (the T positive pairs) is copied K times, each copy with its own negatives Y_k, so
J = (1/T) Σ_t ln h(pos_t) + (1/(K·T)) Σ_{k,t} ln[1 − h(neg_{k,t})]. The functions here return −J,
the value to minimise. ν = T_n / T_m; the paper and the official code use ν = 1.

`terms` selects the Table 4 ablations: "positive" is CL(P) (the first sum of Eq. 9 only),
"negative" is CL(N) (the second only); both keep the 1/(K·T) weighting of the full loss.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from vldist.distributed.collectives import global_sum
from vldist.losses.precision import loss_dtype

Terms = Literal["full", "positive", "negative"]
TERMS = ("full", "positive", "negative")


def _check_inputs(
    pos_target: Tensor, pos_reference: Tensor, neg_target: Tensor, neg_reference: Tensor, nu: float, terms: str
) -> None:
    if terms not in TERMS:
        raise ValueError(f"terms must be one of {TERMS}, got {terms!r}")
    if isinstance(nu, bool) or not isinstance(nu, (int, float)) or not (math.isfinite(nu) and nu > 0):
        raise ValueError(f"nu (= T_n / T_m, Eq. 3) must be a finite number > 0, got {nu!r}")
    named = {
        "pos_target": pos_target,
        "pos_reference": pos_reference,
        "neg_target": neg_target,
        "neg_reference": neg_reference,
    }
    for name, x in named.items():
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor of sentence log-probabilities, "
                f"got {getattr(x, 'dtype', type(x).__name__)}"
            )
    if pos_target.dim() != 1 or pos_reference.shape != pos_target.shape:
        raise ValueError(
            f"pos_target and pos_reference must both have shape (T,), one log-probability per "
            f"positive pair; got {tuple(pos_target.shape)} and {tuple(pos_reference.shape)}"
        )
    n_pos = pos_target.shape[0]
    if neg_target.dim() != 2 or neg_reference.shape != neg_target.shape or neg_target.shape[1] != n_pos:
        raise ValueError(
            f"neg_target and neg_reference must both have shape (K, T) = (K, {n_pos}), one row "
            f"per negative set Y_k; got {tuple(neg_target.shape)} and {tuple(neg_reference.shape)}"
        )
    if neg_target.shape[0] == 0 and terms != "positive":
        raise ValueError(
            f"terms={terms!r} needs K >= 1 negative sets; got neg_target of shape "
            f"{tuple(neg_target.shape)} (only terms='positive' may pass K = 0)"
        )


def _objective_sums(
    pos_target: Tensor, pos_reference: Tensor, neg_target: Tensor, neg_reference: Tensor, nu: float, terms: str
) -> tuple[Tensor, Tensor]:
    """(Σ_t ln h(pos_t), Σ_{k,t} ln[1 − h(neg_{k,t})]) over the given pairs, each 0 when excluded."""
    _check_inputs(pos_target, pos_reference, neg_target, neg_reference, nu, terms)
    dtype = loss_dtype(pos_target, pos_reference, neg_target, neg_reference)
    log_nu = math.log(nu)

    def shifted_log_ratio(target: Tensor, reference: Tensor) -> Tensor:
        # G − ln ν (Eq. 7-8). The reference p_n is fixed (§4.2): detached, so a reference computed
        # with gradient enabled is never trained through this loss.
        return target.to(dtype) - reference.detach().to(dtype) - log_nu

    zero = pos_target.new_zeros((), dtype=dtype)
    # ln h = ln sigmoid(z) and ln(1 − h) = ln sigmoid(−z): the stable form of the official code's
    # log(clip(h, 1e-20, 1)), exact for any G instead of flooring at ln 1e-20 ≈ −46 with no gradient.
    positive = F.logsigmoid(shifted_log_ratio(pos_target, pos_reference)).sum() if terms != "negative" else zero
    negative = F.logsigmoid(-shifted_log_ratio(neg_target, neg_reference)).sum() if terms != "positive" else zero
    return positive, negative


def _negated_objective(positive: Tensor, negative: Tensor, n_sets: int, n_pos: Tensor | int) -> Tensor:
    """−J of Eq. 10: X counted once per copy, i.e. K times, so its sum is divided by T only."""
    return -(positive / n_pos + negative / (max(n_sets, 1) * n_pos))


def contrastive_captioning_loss(
    pos_target: Tensor,
    pos_reference: Tensor,
    neg_target: Tensor,
    neg_reference: Tensor,
    nu: float = 1.0,
    terms: Terms = "full",
) -> Tensor:
    """−J (Eq. 10), the scalar to minimise, for one process holding the whole batch.

    pos_target, pos_reference: (T,) sentence log-probabilities ln p(c_t | I_t) of the T positive pairs
    under the target p_m and the reference p_n. neg_target, neg_reference: (K, T), those of the
    negative pairs (c_/t, I_t) of each of the K negative sets. The reference gets no gradient.
    terms: "full" (CL), "positive" (CL(P)) or "negative" (CL(N)), Table 4.
    """
    positive, negative = _objective_sums(pos_target, pos_reference, neg_target, neg_reference, nu, terms)
    if pos_target.shape[0] == 0:
        raise ValueError("contrastive_captioning_loss needs T >= 1 positive pairs, got pos_target of shape (0,)")
    return _negated_objective(positive, negative, neg_target.shape[0], pos_target.shape[0])


def cross_rank_contrastive_captioning_loss(
    pos_target: Tensor,
    pos_reference: Tensor,
    neg_target: Tensor,
    neg_reference: Tensor,
    nu: float = 1.0,
    terms: Terms = "full",
) -> Tensor:
    """This rank's share of −J (Eq. 10) when each rank holds T_local of the global batch's positives.

    Inputs as in `contrastive_captioning_loss`, restricted to this rank's positives and their
    (K, T_local) negatives (drawn from the global batch: `vldist.losses.negatives`). The local sums
    of Eq. 9 are divided by K·T_global, T_global the sum of T_local over ranks, so the shares summed
    over ranks equal the one-process loss of the whole batch (the convention of
    `vldist.losses.distributed`), and the gradient of each rank's inputs is that one-process
    gradient's slice. K must be the same on every rank; a rank may hold T_local = 0.
    """
    positive, negative = _objective_sums(pos_target, pos_reference, neg_target, neg_reference, nu, terms)
    n_global = global_sum(torch.tensor(float(pos_target.shape[0]), dtype=positive.dtype, device=positive.device))
    if float(n_global) == 0:
        raise ValueError("cross_rank_contrastive_captioning_loss needs T >= 1 positive pairs over all ranks, got 0")
    return _negated_objective(positive, negative, neg_target.shape[0], n_global)
