"""The two-branch networks (Wang, Li & Lazebnik, TPAMI): one branch per modality, then either a
joint embedding space (the embedding network, §3.2) or fusion layers that score a pair (the
similarity network, §3.3).

A branch is FC -> ReLU -> dropout -> FC -> L2 normalisation (nonlinear) or FC -> L2 (linear),
with one batch norm: after the last FC (the paper) or after the first FC, before the ReLU (the
official code), or none.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from vldist.models.common import l2norm
from vldist.models.text_features import text_features

BatchNormPlace = Literal["last", "first", "none"]


class Branch(nn.Module):
    def __init__(
        self,
        in_dim: int,
        hidden: int,
        out_dim: int,
        nonlinear: bool = True,
        dropout: float = 0.5,
        batchnorm: BatchNormPlace = "last",
    ):
        super().__init__()
        if nonlinear:
            layers: list[nn.Module] = [nn.Linear(in_dim, hidden)]
            if batchnorm == "first":
                layers.append(nn.BatchNorm1d(hidden))
            layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, out_dim)]
        else:
            layers = [nn.Linear(in_dim, out_dim)]
            if batchnorm == "first":  # one linear layer: its only FC is also the first
                layers.append(nn.BatchNorm1d(out_dim))
        if batchnorm == "last":
            layers.append(nn.BatchNorm1d(out_dim))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return l2norm(self.layers(x))


# On CPU a block's activations (pairs x the fusion's widest layer) must stay in cache: 16 images x
# 5,000 sentences (40 MB a layer) ran 2.3x slower than 1 x 5,000 (`python bench/two_branch_scoring.py`).
CPU_PAIRS_PER_BLOCK = 8192


class TwoBranchModel(nn.Module):
    """Image vectors and token ids in, normalised embeddings of both out; `fusion` (the
    similarity network's layers) turns an image and a sentence embedding into one score."""

    def __init__(
        self,
        image_dim: int,
        vocab_size: int,
        text_features_kind: str,
        word_dim: int,
        hidden: int,
        embed: int,
        nonlinear: bool,
        dropout: float,
        batchnorm: BatchNormPlace,
        fusion_widths: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.text_features = text_features(text_features_kind, vocab_size, word_dim)
        self.image = Branch(image_dim, hidden, embed, nonlinear, dropout, batchnorm)
        self.text = Branch(self.text_features.out_dim, hidden, embed, nonlinear, dropout, batchnorm)
        self.fusion = None
        if fusion_widths is not None:
            layers: list[nn.Module] = []
            width = embed
            for out in fusion_widths:
                layers += [nn.Linear(width, out), nn.ReLU()]
                width = out
            layers.append(nn.Linear(width, 1))
            self.fusion = nn.Sequential(*layers)

    def embed_images(self, images: Tensor) -> Tensor:
        return self.image(images)

    def embed_captions(self, tokens: Tensor, lengths: Tensor | None = None) -> Tensor:
        return self.text(self.text_features(tokens))

    def forward(self, images: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        return {"image": self.embed_images(images), "text": self.embed_captions(tokens)}

    def pair_scores(self, image: Tensor, text: Tensor) -> Tensor:
        """The similarity network's logit of each row pair: (P, D) x (P, D) -> (P,)."""
        return self.fusion(image * text).squeeze(-1)

    def all_pair_scores(self, image: Tensor, text: Tensor, rows_at_once: int | None = None) -> Tensor:
        """(N, D) x (M, D) -> (N, M) logits of every pair through the fusion layers. Each branch
        ran once; the fusion runs on blocks of pairs: `rows_at_once` images x all sentences when
        given, else (on CPU) blocks of about CPU_PAIRS_PER_BLOCK pairs, one image and a run of its
        sentences at a time, and on an accelerator 16 images x all sentences."""
        out = torch.empty(image.shape[0], text.shape[0], device=image.device)
        if rows_at_once is None and image.device.type == "cpu":
            rows_at_once = max(1, CPU_PAIRS_PER_BLOCK // max(1, text.shape[0]))
            columns = min(text.shape[0], CPU_PAIRS_PER_BLOCK)
        else:
            rows_at_once, columns = rows_at_once or 16, text.shape[0]
        for lo in range(0, image.shape[0], rows_at_once):
            for start in range(0, text.shape[0], columns):
                block = image[lo : lo + rows_at_once, None, :] * text[None, start : start + columns, :]
                out[lo : lo + rows_at_once, start : start + columns] = self.fusion(block).squeeze(-1).float()
        return out
