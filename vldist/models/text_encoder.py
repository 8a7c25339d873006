"""GRU sentence encoder (VSE++/VSRN): word embeddings -> GRU -> last hidden state -> l2norm."""

from __future__ import annotations

import torch
from torch import nn

from vldist.models.common import l2norm, last_hidden_gru


class GRUTextEncoder(nn.Module):
    def __init__(self, vocab_size: int, word_dim: int, embed_size: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)  # as VSE++
        self.gru = nn.GRU(word_dim, embed_size, batch_first=True)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) padded ids, lengths (B,) -> (B, D) unit vectors."""
        return l2norm(last_hidden_gru(self.gru, self.embed(tokens), lengths))
