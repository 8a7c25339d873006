"""ln p(caption | image) for every caption against every image: self-retrieval's score matrix.

Each image is encoded once (the decoder's init_state); the (caption, image) pairs then run through
the decoder's steps in chunks, each chunk picking its images' rows of the encoded state.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def caption_image_logprobs(
    decoder, features: Tensor, mask: Tensor, tokens: Tensor, pad_id: int = 0, pairs_per_chunk: int = 8192
) -> Tensor:
    """(C, N) float32 matrix of sentence log-probabilities (end token included): entry [c, n] is
    ln p(tokens[c] | image n). `tokens` (C, T) start with <start> and are padded with `pad_id`."""
    state = decoder.init_state(features, mask)
    n_captions, n_images = tokens.shape[0], features.shape[0]
    out = torch.empty(n_captions * n_images, dtype=torch.float32)
    pairs = torch.arange(n_captions * n_images, device=tokens.device)
    for chunk in pairs.split(pairs_per_chunk):
        captions = tokens[chunk // n_images]
        captions = captions[:, : int((captions != pad_id).sum(dim=1).max())]  # no steps over padding only
        images = chunk % n_images
        rows = {k: v.index_select(0, images.to(v.device)) for k, v in state.items()}
        total = torch.zeros(len(chunk), dtype=torch.float32, device=tokens.device)
        for t in range(captions.shape[1] - 1):
            logits, rows = decoder.step(captions[:, t], rows)
            target = captions[:, t + 1]
            step = logits.float().log_softmax(dim=-1).gather(1, target[:, None]).squeeze(1)
            total += step.masked_fill(target == pad_id, 0.0)
        out[chunk.cpu()] = total.cpu()
    return out.view(n_captions, n_images)
