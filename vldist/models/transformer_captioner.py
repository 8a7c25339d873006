"""LAViTeR's image-to-text model (ITM, §3.3): a CATR-style transformer captioner over regional features.

CATR (Uppal, "CATR: Caption Transformer") is the encoder-decoder transformer of Vaswani et al.: a
transformer encoder over the image's regions, a transformer decoder over the words read so far
with a causal mask and cross-attention to the encoded regions, and Eq. 13's p(w_t) = softmax(MLP(h_t))
as one linear layer to the vocabulary (the softmax is left to the loss and to the search).

Departures from CATR, kept simple on purpose:

- Positional encodings are 1-D sinusoids (Vaswani et al.) added once, to the projected region
  sequence and to the word embeddings, at the input of the encoder and of the decoder. CATR (after
  DETR) adds them again at every attention input; here the layers are the stock
  ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``.
- Post-norm layers with ReLU, as CATR's defaults; a final LayerNorm after the decoder (CATR's
  ``decoder_norm``), none after the encoder (CATR has none with post-norm).

It follows the step protocol of `vldist.models.generation` (``init_state``/``step``/``forward``),
so greedy decoding and beam search come from there. The loss is not here: the recipe uses
`vldist.losses.cross_rank_token_nll`, which ignores padding (LAViTeR's code counts it).
"""

from __future__ import annotations

import torch
from torch import nn

from vldist.models.common import sinusoidal_positions
from vldist.models.generation import State


class TransformerCaptioner(nn.Module):
    """CATR over region features (B, R, F) with a mask (B, R), True = real region.

    ``forward(features, mask, tokens (B, T)) -> logits (B, T-1, V)`` is teacher forcing: it
    predicts ``tokens[:, 1:]`` from ``tokens[:, :-1]``; ``pad_id`` tokens are masked as keys
    (padding follows the caption, so with the causal mask it never reaches a real position anyway).

    ``init_state`` runs the encoder once: ``{"memory": (B, R, d_model), "mask": (B, R) bool,
    "words": (B, 0) long}``. ``step`` appends one word per row to ``words`` and runs the decoder
    over the whole prefix, returning the last position's logits. That costs O(t^2) per step
    instead of a key/value cache's O(t), which is nothing at caption lengths (<= ``max_len``) and
    keeps ``step`` exactly the computation of ``forward``; every state tensor is batch-first, so
    beam search reorders it with ``index_select``.

    Captions (the decoder's input) are at most ``max_len`` tokens; the region count is not bounded
    (LAViTeR has 289). An image needs at least one real region.
    """

    def __init__(
        self,
        vocab_size: int,
        feature_dim: int,
        d_model: int = 256,
        heads: int = 8,
        encoder_layers: int = 6,
        decoder_layers: int = 6,
        feedforward: int = 1024,
        dropout: float = 0.1,
        max_len: int = 64,
        pad_id: int = 0,
    ):
        super().__init__()
        if d_model % 2:
            raise ValueError(f"d_model must be even for sinusoidal positions, got {d_model}")
        self.d_model, self.max_len, self.pad_id = d_model, max_len, pad_id
        self.project = nn.Linear(feature_dim, d_model)
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.register_buffer("word_positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d_model, heads, feedforward, dropout, batch_first=True),
            encoder_layers,
            enable_nested_tensor=False,
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d_model, heads, feedforward, dropout, batch_first=True),
            decoder_layers,
            norm=nn.LayerNorm(d_model),
        )
        self.out = nn.Linear(d_model, vocab_size)

    def encode(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The encoded regions (B, R, d_model); rows at padded regions are never attended to."""
        x = self.project(features)
        x = x + sinusoidal_positions(x.shape[1], self.d_model, x.device, x.dtype)
        return self.encoder(self.dropout(x), src_key_padding_mask=~mask)

    def decode(self, memory: torch.Tensor, mask: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) at every position of the words (B, T) read so far."""
        length = words.shape[1]
        if length > self.max_len:
            raise ValueError(f"captions are at most max_len={self.max_len} tokens, got {length}")
        x = self.embed(words)
        x = self.dropout(x + self.word_positions[:length].to(x.dtype))
        causal = torch.ones(length, length, dtype=torch.bool, device=words.device).triu(1)  # True = not seen
        h = self.decoder(
            x,
            memory,
            tgt_mask=causal,
            tgt_is_causal=True,
            tgt_key_padding_mask=words == self.pad_id,
            memory_key_padding_mask=~mask,
        )
        return self.out(h)

    def init_state(self, features: torch.Tensor, mask: torch.Tensor) -> State:
        return {
            "memory": self.encode(features, mask),
            "mask": mask,
            "words": torch.zeros(features.shape[0], 0, dtype=torch.long, device=features.device),
        }

    def step(self, words: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        # No key/value cache: the decoder re-reads the whole prefix (simple and exact; cheap at these sizes).
        prefix = torch.cat([state["words"], words[:, None].to(state["words"].dtype)], dim=1)
        logits = self.decode(state["memory"], state["mask"], prefix)[:, -1]
        return logits, {**state, "words": prefix}

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits (B, T-1, V) for ``tokens[:, 1:]``."""
        return self.decode(self.encode(features, mask), mask, tokens[:, :-1])
