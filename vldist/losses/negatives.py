"""Negative captions for Contrastive Learning (Dai & Lin 2017, §4.2), drawn from the global batch.

For each positive pair (c_t, I_t) a negative pair (c_/t, I_t) takes c_/t uniformly from C_/I_t,
the ground-truth captions of every *other* image (the paper's sampling); K sets are drawn (Eq. 10),
afresh every step. (The official code instead pairs each image with a random other image, taken
from a permutation, whose 5 captions fill the image's 5 negative slots; this module follows the
paper, so with uneven caption counts an image's chance is proportional to its number of captions.)

Across ranks: `gather_captions` concatenates every rank's captions in rank order, then every rank
calls `draw_negatives` on the same global image ids with a generator seeded the same way, so all
ranks hold the same draw; a rank reads its own columns, offset .. offset + n_local:

    tokens, lengths, image_ids, offset = gather_captions(my_tokens, my_lengths, my_image_ids)
    draw = draw_negatives(image_ids, k, generator)[:, offset:offset + len(my_image_ids)]
    neg_tokens, neg_lengths = tokens[draw], lengths[draw]      # (K, n_local, L), paired with my images

Image ids must identify images across the whole global batch (e.g. dataset indices), not
positions within a rank's slice.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from vldist.distributed.collectives import all_gather_rows, global_max, world


def step_generator(seed: int, step: int, micro: int = 0) -> torch.Generator:
    """A generator seeded from (job seed, optimizer step, micro-batch): every rank draws alike,
    and every draw differs from the others of the run."""
    state = np.random.SeedSequence([seed, step, micro]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def draw_negatives(caption_images: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """(K, N) global caption indices: entry [k, t] is a caption of an image other than caption t's,
    uniform among all such captions, drawn independently for each set k and each t.

    caption_images: (N,) integer image id of each global caption. The draw depends only on
    `caption_images` and the generator's state, so ranks that pass the same global ids and
    generators seeded alike draw the same. Vectorised: one sort and one uniform number per entry.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (the number of negative sets, K in Eq. 10) must be an int >= 1, got {k!r}")
    if not isinstance(caption_images, Tensor):
        raise TypeError(f"caption_images must be a tensor of image ids, got {type(caption_images).__name__}")
    if caption_images.dim() != 1:
        raise ValueError(
            f"caption_images must be 1-D with one image id per caption, got shape {tuple(caption_images.shape)}"
        )
    if caption_images.is_floating_point() or caption_images.is_complex() or caption_images.dtype == torch.bool:
        raise TypeError(f"caption_images must hold integer image ids, got {caption_images.dtype}")
    n = caption_images.shape[0]
    if n == 0:
        return caption_images.new_zeros((k, 0), dtype=torch.long)
    images, image_of, counts = torch.unique(caption_images, return_inverse=True, return_counts=True)
    if images.numel() == 1:
        raise ValueError(
            f"all {n} captions belong to one image ({int(images[0])}): no caption of another image "
            f"can serve as a negative; a contrastive batch needs at least two images"
        )

    # Captions grouped by image (stable: deterministic order). Caption t's candidates are all of
    # `by_image` except its own image's block [start, start + own): draw a position among the
    # n − own others and step over that block.
    by_image = torch.sort(image_of, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    own, start = counts[image_of], starts[image_of]
    n_others = n - own  # (N,), each >= 1
    uniform = torch.rand((k, n), generator=generator, dtype=torch.float64, device=generator.device)
    # float64 uniforms: the floor is uniform over 0 .. n_others − 1 up to ~2^-53 per value
    pick = (uniform.to(caption_images.device) * n_others).long().clamp_(max=n_others - 1)
    pick = pick + own * (pick >= start)
    return by_image[pick]


def gather_captions(tokens: Tensor, lengths: Tensor, image_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Every rank's captions concatenated in rank order: (tokens (N, L_max), lengths (N,),
    image_ids (N,), where this rank's rows start).

    tokens: (n, L) token ids padded with 0; lengths, image_ids: (n,). Tokens are padded with 0 to
    the longest L on any rank. Ids need no gradient, so this is a plain gather. In a single
    process the inputs come back unchanged with offset 0.
    """
    n = tokens.shape[0] if tokens.dim() == 2 else -1
    if n < 0 or lengths.shape != (n,) or image_ids.shape != (n,):
        raise ValueError(
            f"gather_captions needs tokens (n, L), lengths (n,) and image_ids (n,); got "
            f"{tuple(tokens.shape)}, {tuple(lengths.shape)} and {tuple(image_ids.shape)}"
        )
    if world()[1] == 1:
        return tokens, lengths, image_ids, 0
    width = global_max(tokens.shape[1], tokens.device)
    # One gather for everything: rows of [length, image id, tokens padded to the global width].
    rows = torch.cat(
        [lengths[:, None].long(), image_ids[:, None].long(), F.pad(tokens.long(), (0, width - tokens.shape[1]))], dim=1
    )
    rows, offset = all_gather_rows(rows)
    return (rows[:, 2:].to(tokens.dtype), rows[:, 0].to(lengths.dtype), rows[:, 1].to(image_ids.dtype), offset)
