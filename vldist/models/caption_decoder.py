"""Attention GRU caption decoder over region features (VSRN's generation branch, Eq. 9).

At each step the decoder attends over the (masked) regions with additive attention, feeds the
context and the previous word to a GRU cell, and predicts the next word. It follows the step
protocol of `vldist.models.generation` (init_state/step), which does the greedy and beam decoding.

Teacher forcing (`forward`) runs step by step only what feeds the recurrence, the attention and
the GRU cell; the word embeddings are looked up before the loop, and dropout and the vocabulary
projection (the largest per-token matmul) run once over all steps. `step` is the per-token
reference it equals (tests/unit/test_decoder_loops.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vldist.distributed.zero import partitioned
from vldist.models import generation
from vldist.models.attention_gru_loop import attention_gru_hidden, takes_written_out_path
from vldist.models.common import checkpointed_step, masked_mean
from vldist.models.dropout import Dropout
from vldist.models.generation import State
from vldist.models.running_captions import RunningCaptions, running_captions


class AttentionCaptionDecoder(nn.Module):
    # train.activation_checkpointing recomputes each teacher-forced step (its attention over the
    # regions is the loop's largest activation), not the whole unroll at once
    checkpoint_steps = False

    def __init__(self, vocab_size: int, feature_dim: int, word_dim: int = 300, hidden: int = 512, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        self.init_hidden = nn.Linear(feature_dim, hidden)
        self.att_features = nn.Linear(feature_dim, hidden)
        self.att_hidden = nn.Linear(hidden, hidden)
        self.att_score = nn.Linear(hidden, 1)
        self.cell = nn.GRUCell(word_dim + feature_dim, hidden)
        self.dropout = Dropout(dropout)
        self.out = nn.Linear(hidden, vocab_size)

    def _attend(
        self, keys: torch.Tensor, features: torch.Tensor, padding: torch.Tensor, h: torch.Tensor
    ) -> torch.Tensor:
        """The attention context (B, F); padding (B, R) is True at padded regions."""
        scores = self.att_score(torch.tanh(keys + self.att_hidden(h)[:, None, :])).squeeze(-1)
        scores = scores.masked_fill(padding, torch.finfo(scores.dtype).min)
        # weights (B, 1, R) @ features (B, R, F): one batched GEMM, no (B, R, F) product to keep
        return torch.bmm(scores.softmax(dim=-1).unsqueeze(1), features).squeeze(1)

    def init_state(self, features: torch.Tensor, mask: torch.Tensor) -> State:
        return {
            "keys": self.att_features(features),
            "features": features,
            "mask": mask,
            "h": torch.tanh(self.init_hidden(masked_mean(features, mask))),
        }

    def _advance(self, word, h, keys, features, padding) -> torch.Tensor:
        """One step of the recurrence from the embedded word: attention, then the GRU cell."""
        context = self._attend(keys, features, padding, h)
        return self.cell(torch.cat([word, context], dim=-1), h)

    def step(self, words: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        h = self._advance(self.embed(words), state["h"], state["keys"], state["features"], ~state["mask"])
        return self.out(self.dropout(h)), {**state, "h": h}

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits (B, T-1, V) predicting tokens[:, 1:] from tokens[:, :-1]."""
        return self.teacher_forcing(self.init_state(features, mask), tokens)

    def teacher_forcing(self, state: State, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T-1, V) of `tokens` (B, T) read from `state` on: `step` over the tokens, with
        only the attention and the GRU cell in the loop. On CPU each step runs only the captions
        that still predict a word (models/running_captions.py); logits of finished rows' padding
        are then those of a zero hidden state."""
        # Under ZeRO-3 every rank must call the submodules equally often (each call gathers their
        # parameters across ranks), so the full batch runs every step there.
        running = None if partitioned(self.parameters()) else running_captions(tokens)
        if takes_written_out_path(self, state["features"]):
            rows = running or RunningCaptions(None, [tokens.shape[0]] * (tokens.shape[1] - 1))
            hidden = attention_gru_hidden(
                self,
                rows.sort(self.embed(tokens[:, :-1])),
                *(rows.sort(state[name]) for name in ("h", "keys", "features")),
                rows.sort(~state["mask"]),
                rows.running,
            )
            return self._readout(rows.unsort(hidden, dim=1))
        if running is None:
            return self._unrolled(state, tokens)
        words = running.sort(self.embed(tokens[:, :-1])).unbind(1)
        h, keys, features = (running.sort(state[name]) for name in ("h", "keys", "features"))
        padding, rows, hidden = running.sort(~state["mask"]), h.shape[0], []
        for word, n in zip(words, running.running, strict=True):
            if n:
                h = checkpointed_step(self, self._advance, word[:n], h[:n], keys[:n], features[:n], padding[:n])
            hidden.append(F.pad(h, (0, 0, 0, rows - n)) if n else h.new_zeros(rows, h.shape[1]))
        return self._readout(running.unsort(torch.stack(hidden), dim=1))

    def _unrolled(self, state: State, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher forcing with every row at every step."""
        # unbind: one view per step, whose backward is one stack; indexing words[:, t] would
        # zero-fill a buffer of all the words for each step's gradient
        words = self.embed(tokens[:, :-1]).unbind(1)
        padding = ~state["mask"]
        h, hidden = state["h"], []
        for word in words:
            h = checkpointed_step(self, self._advance, word, h, state["keys"], state["features"], padding)
            hidden.append(h)
        if not hidden:
            return self.out(h.new_zeros(h.shape[0], 0, h.shape[1]))
        return self._readout(torch.stack(hidden))

    def _readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (B, T-1, V) of the hidden states (T-1, B, H)."""
        # Time-major under dropout: on the CPU one draw over (T, B, H) takes the same masks as
        # `step`'s T draws over (B, H) (models/dropout.py), so a seeded run matches the per-token
        # reference.
        return self.out(self.dropout(hidden).transpose(0, 1))

    def generate(
        self,
        features: torch.Tensor,
        mask: torch.Tensor,
        start_id: int,
        end_id: int,
        max_len: int = 20,
        beam_size: int = 1,
    ) -> torch.Tensor:
        """(B, <= max_len) word ids after <start>, padded with 0 after <end>; greedy by default.

        See `vldist.models.generation.generate`."""
        return generation.generate(self, features, mask, start_id, end_id, max_len, beam_size)
