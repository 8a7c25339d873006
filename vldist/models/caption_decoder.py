"""Attention GRU caption decoder over region features (VSRN's generation branch, Eq. 9).

At each step the decoder attends over the (masked) regions with additive attention, feeds the
context and the previous word to a GRU cell, and predicts the next word.
"""

from __future__ import annotations

import torch
from torch import nn

from vldist.models.common import masked_mean


class AttentionCaptionDecoder(nn.Module):
    def __init__(self, vocab_size: int, feature_dim: int, word_dim: int = 300, hidden: int = 512, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        self.init_hidden = nn.Linear(feature_dim, hidden)
        self.att_features = nn.Linear(feature_dim, hidden)
        self.att_hidden = nn.Linear(hidden, hidden)
        self.att_score = nn.Linear(hidden, 1)
        self.cell = nn.GRUCell(word_dim + feature_dim, hidden)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, vocab_size)

    def _attend(self, keys: torch.Tensor, features: torch.Tensor, mask: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        scores = self.att_score(torch.tanh(keys + self.att_hidden(h)[:, None, :])).squeeze(-1)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return (scores.softmax(dim=-1).unsqueeze(-1) * features).sum(dim=1)

    def _step(self, word: torch.Tensor, keys, features, mask, h) -> tuple[torch.Tensor, torch.Tensor]:
        context = self._attend(keys, features, mask, h)
        h = self.cell(torch.cat([self.embed(word), context], dim=-1), h)
        return self.out(self.dropout(h)), h

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits (B, T-1, V) predicting tokens[:, 1:] from tokens[:, :-1]."""
        keys = self.att_features(features)
        h = torch.tanh(self.init_hidden(masked_mean(features, mask)))
        logits = []
        for t in range(tokens.shape[1] - 1):
            step_logits, h = self._step(tokens[:, t], keys, features, mask, h)
            logits.append(step_logits)
        return torch.stack(logits, dim=1)

    @torch.no_grad()
    def generate(self, features: torch.Tensor, mask: torch.Tensor, start_id: int, end_id: int, max_len: int = 20) -> torch.Tensor:
        """Greedy decoding: (B, <= max_len) word ids, stopping once every caption has ended."""
        keys = self.att_features(features)
        h = torch.tanh(self.init_hidden(masked_mean(features, mask)))
        word = torch.full((features.shape[0],), start_id, dtype=torch.long, device=features.device)
        words, ended = [], torch.zeros_like(word, dtype=torch.bool)
        for _ in range(max_len):
            step_logits, h = self._step(word, keys, features, mask, h)
            word = step_logits.argmax(dim=-1)
            words.append(word)
            ended |= word == end_id
            if bool(ended.all()):
                break
        return torch.stack(words, dim=1)
