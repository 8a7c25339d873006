"""AttnGAN's DAMSM loss (Deep Attentional Multimodal Similarity Model), the image-text matching loss
LAViTeR trains its visual-textual alignment with (L_DAMSM, and L_FI / L_FT on generated images and
text), with exact global-batch negatives across ranks.

Source: Xu et al., AttnGAN (CVPR 2018), §3.3, and its code (`words_loss`, `sent_loss`,
`func_attention`), which LAViTeR's MMRL code copies; the equations LAViTeR's text lost are rebuilt
in ../shared/papers/notes-laviter.md ("VTA", Eq. 4-8). For caption i (T_i real word vectors e)
and image j (R region vectors v):

    s = e v^T                          (T_i x R raw dot products)
    s̄ = softmax of s over the words    (per region; padding words excluded)
    α = softmax of γ1 s̄ over regions   (per word)
    c_t = Σ_r α_{t,r} v_r              (the region context of word t)
    R(i, j) = log Σ_t exp(γ2 cos(c_t, e_t))

and L1_w, L2_w are the cross-entropies of the logits γ3 R over the batch, captions over images
("words_t2i") and images over captions ("words_i2t"), the matching pair the label. L1_s, L2_s
are the same with γ3 cos(global image vector, sentence vector) ("sentence_t2i", "sentence_i2t").
L_DAMSM = L1_w + L2_w + L1_s + L2_s.

Choices, as AttnGAN's and MMRL's code (not the paper's text):
- no 1/γ2 exponent: R = log Σ_t exp(γ2 cos), not (log Σ_t exp(γ2 cos))^(1/γ2);
- each cross-entropy is a mean over the batch, not a sum;
- no class masking: AttnGAN on CUB masks negatives of the same bird class; here every other
  pair of the batch is a negative (AttnGAN on COCO), except pairs of one image (`identity`: a
  batch drawn with replacement can hold an image twice), which are left out of the softmax.
- cosine = x·y / max(|x| |y|, 1e-8), AttnGAN's eps; padding words (positions >= length) never
  enter: they are zeroed before anything else and masked out of both word-wise reductions.
- math in float32 at least (bf16/fp16 inputs are upcast, autocast is switched off inside), float64
  stays float64.

Across ranks (losses/distributed.py's convention): each term is a mean over the global batch of
per-row cross-entropies, so a rank's share is the sum over its own rows divided by the global
batch size. Embeddings are all-gathered with gradient; each rank scores its captions against every
image and its images against every caption, so the shares sum to the loss of one process on the
concatenated batch and gradients flow back to the rank that produced each embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vldist.distributed.collectives import all_gather_rows, all_gather_with_grad, global_max, world
from vldist.losses.not_negative import gather_identities, same_identity
from vldist.losses.precision import loss_dtype, no_autocast

PARTS = ("words_t2i", "words_i2t", "sentence_t2i", "sentence_i2t")
_EPS = 1e-8
# Largest intermediate (captions x images x T x max(R, D) values) computed at once; larger
# caption sets are scored in chunks of captions.
_CHUNK_ELEMENTS = 2**24


def _check_words(words: Tensor, lengths: Tensor) -> None:
    if words.dim() != 3:
        raise ValueError(f"words must have shape (B, T, D), got {tuple(words.shape)}")
    if lengths.shape != words.shape[:1] or lengths.is_floating_point() or lengths.is_complex():
        raise ValueError(
            f"lengths must be an integer tensor of shape ({words.shape[0]},), one per caption; "
            f"got {lengths.dtype} {tuple(lengths.shape)}"
        )
    if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > words.shape[1]):
        raise ValueError(
            f"every caption needs 1 <= length <= T = {words.shape[1]} real words; "
            f"got lengths from {int(lengths.min())} to {int(lengths.max())}"
        )


def _check_regions(regions: Tensor, words: Tensor) -> None:
    if regions.dim() != 3 or regions.shape[2] != words.shape[2]:
        raise ValueError(
            f"regions must have shape (B, R, D) with D = {words.shape[2]} as the words; got {tuple(regions.shape)}"
        )


def _check_batch(words: Tensor, lengths: Tensor, regions: Tensor, sentence: Tensor, image: Tensor) -> None:
    _check_words(words, lengths)
    _check_regions(regions, words)
    b, d = words.shape[0], words.shape[2]
    for name, x in {"sentence": sentence, "image": image}.items():
        if x.shape != (b, d):
            raise ValueError(f"{name} must have shape (B, D) = ({b}, {d}), got {tuple(x.shape)}")
    if regions.shape[0] != b:
        raise ValueError(f"one image per caption: words hold {b} captions, regions {regions.shape[0]} images")


def cosine_matrix(a: Tensor, b: Tensor) -> Tensor:
    """(A, D) x (B, D) -> (A, B) cosines, AttnGAN's `sent_loss` form: a·b / max(|a| |b|, eps)."""
    return (a @ b.T) / (a.norm(dim=1)[:, None] * b.norm(dim=1)[None, :]).clamp(min=_EPS)


def _scores_chunk(words: Tensor, real: Tensor, regions: Tensor, gamma1: float, gamma2: float) -> Tensor:
    """R(i, j) for captions `words` (c, T, D) with real-word mask `real` (c, T), padding zeroed,
    against images `regions` (N, R, D): (c, N)."""
    s = torch.einsum("itd,jrd->ijtr", words, regions)  # (c, N, T, R) raw dot products
    padding = ~real[:, None, :, None]
    s = s.masked_fill(padding, float("-inf")).softmax(dim=2)  # over the real words, per region
    alpha = (gamma1 * s).softmax(dim=3)  # over regions, per word
    context = alpha @ regions[None]  # (c, N, T, D)
    e = words[:, None]  # (c, 1, T, D)
    cos = (context * e).sum(-1) / (context.norm(dim=-1) * e.norm(dim=-1)).clamp(min=_EPS)  # (c, N, T)
    return (gamma2 * cos).masked_fill(~real[:, None, :], float("-inf")).logsumexp(dim=2)


def word_region_scores(
    words: Tensor, lengths: Tensor, regions: Tensor, gamma1: float = 4.0, gamma2: float = 5.0
) -> Tensor:
    """The word-level matching score R(caption i, image j) of every pair: (Nc, Ni).

    words (Nc, T, D) with lengths (Nc,) real words each (the rest is padding and never matters);
    regions (Ni, R, D). Nc and Ni may differ (a rank's captions against the global batch's
    images). Computed in float32 at least; caption chunks bound the intermediates to about
    `_CHUNK_ELEMENTS` values each (autograd still keeps every chunk's, as AttnGAN's loop does).
    """
    _check_words(words, lengths)
    _check_regions(regions, words)
    n_captions, t, d = words.shape
    n_images, r = regions.shape[:2]
    dtype = loss_dtype(words, regions)
    with no_autocast(words):
        words, regions = words.to(dtype), regions.to(dtype)
        real = torch.arange(t, device=words.device)[None, :] < lengths.to(words.device)[:, None]  # (Nc, T)
        words = torch.where(real[..., None], words, 0.0)  # padding content never enters, not even NaN
        step = max(1, _CHUNK_ELEMENTS // max(1, n_images * t * max(r, d)))
        # At least one (possibly empty) chunk: a rank holding no pairs still takes part in the graph
        # of the gathered embeddings, whose backward is a collective.
        return torch.cat(
            [
                _scores_chunk(words[c : c + step], real[c : c + step], regions, gamma1, gamma2)
                for c in range(0, max(n_captions, 1), step)
            ]
        )


def _ce_share(logits: Tensor, offset: int, total: int, same: Tensor | None = None) -> Tensor:
    """Sum over the rows of `logits` (local rows x global columns) of the cross-entropy with the
    matching column `offset + row`, divided by the global batch size: the rows' share of the mean.
    same: (rows x columns) bool, pairs of one image; those other than the label are left out of
    the softmax, as if the copy were not in the batch."""
    labels = torch.arange(logits.shape[0], device=logits.device) + offset
    if same is not None:
        others = same.to(logits.device).clone()
        others[torch.arange(logits.shape[0], device=logits.device), labels] = False
        logits = logits.masked_fill(others, float("-inf"))
    return F.cross_entropy(logits, labels, reduction="sum") / total


def damsm_parts(
    words: Tensor,
    lengths: Tensor,
    regions: Tensor,
    sentence: Tensor,
    image: Tensor,
    gamma1: float = 4.0,
    gamma2: float = 5.0,
    gamma3: float = 10.0,
    identity: Tensor | None = None,
) -> dict[str, Tensor]:
    """The four DAMSM terms of one batch (module docstring): {"words_t2i" (L1_w, captions over
    images), "words_i2t" (L2_w, images over captions), "sentence_t2i", "sentence_i2t"}, float32
    scalars at least. Their sum is `damsm_loss`. identity: optional (B,) image ids; a caption
    and an image of one id are never a negative pair."""
    _check_batch(words, lengths, regions, sentence, image)
    b = words.shape[0]
    if b == 0:
        raise ValueError("damsm_parts needs a batch of at least one caption-image pair")
    same = same_identity(identity, identity) if identity is not None else None  # symmetric
    dtype = loss_dtype(words, regions, sentence, image)
    with no_autocast(words):
        word_logits = gamma3 * word_region_scores(words, lengths, regions, gamma1, gamma2)  # (captions, images)
        sentence_logits = gamma3 * cosine_matrix(sentence.to(dtype), image.to(dtype))
        return {
            "words_t2i": _ce_share(word_logits, 0, b, same),
            "words_i2t": _ce_share(word_logits.T, 0, b, same),
            "sentence_t2i": _ce_share(sentence_logits, 0, b, same),
            "sentence_i2t": _ce_share(sentence_logits.T, 0, b, same),
        }


def damsm_loss(
    words: Tensor,
    lengths: Tensor,
    regions: Tensor,
    sentence: Tensor,
    image: Tensor,
    gamma1: float = 4.0,
    gamma2: float = 5.0,
    gamma3: float = 10.0,
    identity: Tensor | None = None,
) -> Tensor:
    """L_DAMSM = L1_w + L2_w + L1_s + L2_s of one batch of B caption-image pairs (pair i matches).

    words (B, T, D) word vectors with lengths (B,) real words per caption; regions (B, R, D)
    region vectors; sentence and image (B, D) global vectors. γ1, γ2, γ3 as AttnGAN (4, 5, 10).
    identity: optional (B,) image ids; pairs of one image are never negatives.
    """
    return sum(damsm_parts(words, lengths, regions, sentence, image, gamma1, gamma2, gamma3, identity).values())


def cross_rank_damsm_parts(
    words: Tensor,
    lengths: Tensor,
    regions: Tensor,
    sentence: Tensor,
    image: Tensor,
    gamma1: float = 4.0,
    gamma2: float = 5.0,
    gamma3: float = 10.0,
    gather: bool = True,
    identity: Tensor | None = None,
) -> dict[str, Tensor]:
    """This rank's shares of the four DAMSM terms of the global batch (`damsm_parts`' keys).

    With gather, the rank's captions are scored against every rank's images and its images
    against every rank's captions; each share is the sum of its rows' cross-entropies over the
    global batch size, so the shares summed over ranks equal `damsm_parts` of the concatenated
    batch. Ranks may hold different numbers of pairs and pad their words to different T; R and D
    must agree. Memory: the global batch's embeddings and 2 x (B_local x B) scores per rank.
    Without gather (or in one process), `damsm_parts` of the local batch. identity: optional
    (B_local,) image ids (batch["identity"]), gathered: pairs of one image are never negatives.
    """
    if world()[1] == 1 or not gather:
        return damsm_parts(words, lengths, regions, sentence, image, gamma1, gamma2, gamma3, identity)
    _check_batch(words, lengths, regions, sentence, image)
    dtype = loss_dtype(words, regions, sentence, image)
    with no_autocast(words):
        words, regions, sentence, image = (x.to(dtype) for x in (words, regions, sentence, image))
        t = global_max(words.shape[1], words.device)
        all_words, offset = all_gather_with_grad(F.pad(words, (0, 0, 0, t - words.shape[1])))
        all_lengths, _ = all_gather_rows(lengths)
        all_regions, _ = all_gather_with_grad(regions)
        all_sentence, _ = all_gather_with_grad(sentence)
        all_image, _ = all_gather_with_grad(image)
        total = all_image.shape[0]
        if total == 0:
            raise ValueError("cross_rank_damsm_parts needs at least one caption-image pair over all ranks")
        mine, everyone = gather_identities(identity, words.shape[0], words.device)
        same = same_identity(mine, everyone)  # caption j and image j share an identity
        t2i = gamma3 * word_region_scores(words, lengths, all_regions, gamma1, gamma2)  # my captions x all images
        i2t = gamma3 * word_region_scores(all_words, all_lengths, regions, gamma1, gamma2).T  # my images x all captions
        return {
            "words_t2i": _ce_share(t2i, offset, total, same),
            "words_i2t": _ce_share(i2t, offset, total, same),
            "sentence_t2i": _ce_share(gamma3 * cosine_matrix(sentence, all_image), offset, total, same),
            "sentence_i2t": _ce_share(gamma3 * cosine_matrix(image, all_sentence), offset, total, same),
        }


def cross_rank_damsm_loss(
    words: Tensor,
    lengths: Tensor,
    regions: Tensor,
    sentence: Tensor,
    image: Tensor,
    gamma1: float = 4.0,
    gamma2: float = 5.0,
    gamma3: float = 10.0,
    gather: bool = True,
    identity: Tensor | None = None,
) -> Tensor:
    """This rank's share of `damsm_loss` of the global batch: the sum of `cross_rank_damsm_parts`.
    The shares summed over ranks equal `damsm_loss` of the concatenated batch (the engine
    multiplies by the world size before backward). Without gather (or in one process),
    `damsm_loss` of the local batch, its negatives from the local slice only."""
    return sum(
        cross_rank_damsm_parts(
            words, lengths, regions, sentence, image, gamma1, gamma2, gamma3, gather, identity
        ).values()
    )
