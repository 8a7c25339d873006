"""The two base captioners of CL (Dai and Lin, NIPS 2017): AdaptiveAttention and Neuraltalk2.

Both follow the step protocol of `vldist.models.generation` (``init_state``/``step``, and
``forward`` for teacher forcing), so greedy decoding and beam search come from there.
"""

from __future__ import annotations

import torch
from torch import nn

from vldist.models.common import masked_mean
from vldist.models.dropout import Dropout
from vldist.models.generation import State


class AdaptiveAttentionDecoder(nn.Module):
    """Lu, Xiong, Parikh and Socher, "Knowing When to Look: Adaptive Attention via a Visual Sentinel
    for Image Captioning", CVPR 2017.

    Spatial features v_i = ReLU(W_a a_i) and a global feature v_g = ReLU(W_b mean(a)) (masked mean);
    an LSTM reads x_t = [w_t; v_g]. A visual sentinel s_t = sigmoid(W_x x_t + W_h h_{t-1}) * tanh(m_t)
    competes with the regions in one softmax over z_i = w_h^T tanh(W_v v_i + W_g h_t) and
    w_h^T tanh(W_s s_t + W_g h_t); its weight beta mixes c_hat = beta s_t + (1 - beta) c_t, and
    logits = W_p(dropout(c_hat + h_t)). The initial h and m are zeros, as in the paper.

    ``step`` leaves the attention it used in the state: ``attention`` (B, R + 1), the weights over
    the regions (zero on padding) and, last, the sentinel's weight beta; they sum to 1.
    """

    def __init__(self, vocab_size: int, feature_dim: int, hidden: int = 512, embed: int = 512, dropout: float = 0.5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed, padding_idx=0)
        self.spatial = nn.Linear(feature_dim, hidden)  # W_a
        self.global_image = nn.Linear(feature_dim, embed)  # W_b
        self.lstm = nn.LSTMCell(2 * embed, hidden)
        self.sentinel_input = nn.Linear(2 * embed, hidden)  # W_x
        self.sentinel_hidden = nn.Linear(hidden, hidden, bias=False)  # W_h
        self.att_regions = nn.Linear(hidden, hidden)  # W_v
        self.att_sentinel = nn.Linear(hidden, hidden, bias=False)  # W_s
        self.att_query = nn.Linear(hidden, hidden, bias=False)  # W_g
        self.att_score = nn.Linear(hidden, 1, bias=False)  # w_h
        self.dropout = Dropout(dropout)
        self.out = nn.Linear(hidden, vocab_size)  # W_p

    def init_state(self, features: torch.Tensor, mask: torch.Tensor) -> State:
        regions = torch.relu(self.spatial(features))
        zeros = regions.new_zeros(features.shape[0], regions.shape[-1])
        return {
            "regions": regions,
            "region_keys": self.att_regions(regions),
            "mask": mask,
            "global": torch.relu(self.global_image(masked_mean(features, mask))),
            "h": zeros,
            "m": zeros,
        }

    def _readout(self, x, h_prev, h, m, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """Sentinel, adaptive attention and word logits for (B, T, .) steps: (logits, attention)."""
        return self._attend(self.sentinel_input(x), h_prev, h, m, state)

    def _attend(self, sentinel_in, h_prev, h, m, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """`_readout` given W_x x_t + b (B, T, hidden); the rest reads the image from `state`."""
        sentinel = torch.sigmoid(sentinel_in + self.sentinel_hidden(h_prev)) * torch.tanh(m)
        query = self.att_query(h)
        region_scores = self.att_score(torch.tanh(state["region_keys"][:, None] + query[:, :, None])).squeeze(-1)
        region_scores = region_scores.masked_fill(~state["mask"][:, None], torch.finfo(region_scores.dtype).min)
        sentinel_score = self.att_score(torch.tanh(self.att_sentinel(sentinel) + query))
        attention = torch.cat([region_scores, sentinel_score], dim=-1).softmax(dim=-1)
        # beta s_t + (1 - beta) c_t, with (1 - beta) alpha_i being the softmax's region weights
        c_hat = attention[..., :-1] @ state["regions"] + attention[..., -1:] * sentinel
        return self.out(self.dropout(c_hat + h)), attention

    def step(self, words: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        x = torch.cat([self.embed(words), state["global"]], dim=-1)
        h, m = self.lstm(x, (state["h"], state["m"]))
        logits, attention = self._readout(x[:, None], state["h"][:, None], h[:, None], m[:, None], state)
        return logits[:, 0], {**state, "h": h, "m": m, "attention": attention[:, 0]}

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits (B, T-1, V). Only the LSTM runs step by step; the attention, which
        does not feed back into it, runs over all steps at once."""
        state = self.init_state(features, mask)
        x = torch.cat([self.embed(tokens[:, :-1]), state["global"][:, None].expand(-1, tokens.shape[1] - 1, -1)], -1)
        h, m, hs, ms = state["h"], state["m"], [], []
        for x_t in x.unbind(1):  # one view per step: see caption_decoder.py's teacher_forcing
            h, m = self.lstm(x_t, (h, m))
            hs.append(h)
            ms.append(m)
        h_all = torch.stack(hs, dim=1)
        h_prev = torch.cat([state["h"][:, None], h_all[:, :-1]], dim=1)
        return self._readout(x, h_prev, h_all, torch.stack(ms, dim=1), state)[0]

    # ------------------------------------------------------------------ pair scoring
    # vldist.models.caption_scoring's PairScorer: k captions against N images, laid out (N, k, .) so
    # that `_attend`'s (B, T, .) steps read N images x k captions. The LSTM's and the sentinel's input
    # x_t = [w_t; v_g] is projected as W [w_t; 0] per caption token plus W [0; v_g] + b per image,
    # so no pair pays for the input projections (over half of the step's multiply-adds).

    def pair_state(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[State, State]:
        state = self.init_state(features, mask)
        embed = self.embed.embedding_dim
        images = {
            "regions": state["regions"],
            "region_keys": state["region_keys"],
            "mask": state["mask"],
            "gates": nn.functional.linear(state["global"], self.lstm.weight_ih[:, embed:], self.lstm.bias_ih),
            "sentinel": nn.functional.linear(
                state["global"], self.sentinel_input.weight[:, embed:], self.sentinel_input.bias
            ),
        }
        return images, {"h": state["h"][:, None], "m": state["m"][:, None]}

    def pair_words(self, tokens: torch.Tensor) -> State:
        words = self.embed(tokens[:, :-1])
        embed = self.embed.embedding_dim
        return {
            "gates": nn.functional.linear(words, self.lstm.weight_ih[:, :embed]),
            "sentinel": nn.functional.linear(words, self.sentinel_input.weight[:, :embed]),
        }

    def pair_step(self, words: State, images: State, carry: State) -> tuple[torch.Tensor, State]:
        h_prev, m_prev = carry["h"], carry["m"]
        gates = nn.functional.linear(h_prev, self.lstm.weight_hh, self.lstm.bias_hh) + (
            images["gates"][:, None] + words["gates"][None]
        )
        h, m = lstm_update(gates, m_prev)
        sentinel_in = images["sentinel"][:, None] + words["sentinel"][None]
        logits, _ = self._attend(sentinel_in, h_prev, h, m, images)
        return logits, {"h": h, "m": m}


def lstm_update(gates: torch.Tensor, cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, c) of an LSTM cell from its summed gate pre-activations (., 4 hidden) in torch's order
    (input, forget, cell, output), with the operations of torch's CPU LSTM cell."""
    ingate, forgetgate, cellgate, outgate = gates.chunk(4, dim=-1)
    cell = forgetgate.sigmoid() * cell + ingate.sigmoid() * cellgate.tanh()
    return outgate.sigmoid() * cell.tanh(), cell


class ShowTellDecoder(nn.Module):
    """Neuraltalk2: Vinyals, Toshev, Bengio and Erhan, "Show and Tell: A Neural Image Caption
    Generator", CVPR 2015 (Karpathy's Neuraltalk2 implementation).

    No attention: the image vector (masked mean of the regions -> Linear to ``embed``) is the LSTM's
    input at step -1, before ``<start>``; then the words. logits = Linear(dropout(h_t)).
    ``init_state`` runs the image step.
    """

    def __init__(self, vocab_size: int, feature_dim: int, hidden: int = 512, embed: int = 512, dropout: float = 0.5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed, padding_idx=0)
        self.image = nn.Linear(feature_dim, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.dropout = Dropout(dropout)
        self.out = nn.Linear(hidden, vocab_size)

    def _run(self, inputs: torch.Tensor, hc: tuple[torch.Tensor, torch.Tensor] | None):
        """The LSTM over (B, T, embed); the state is kept batch-first as (B, hidden) tensors."""
        outputs, (h, c) = self.lstm(inputs, None if hc is None else (hc[0][None], hc[1][None]))
        return outputs, {"h": h[0], "c": c[0]}

    def init_state(self, features: torch.Tensor, mask: torch.Tensor) -> State:
        return self._run(self.image(masked_mean(features, mask))[:, None], None)[1]

    def step(self, words: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        outputs, state = self._run(self.embed(words)[:, None], (state["h"], state["c"]))
        return self.out(self.dropout(outputs[:, 0])), state

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits (B, T-1, V), the image and the words through the LSTM at once."""
        image = self.image(masked_mean(features, mask))[:, None]
        outputs, _ = self._run(torch.cat([image, self.embed(tokens[:, :-1])], dim=1), None)
        return self.out(self.dropout(outputs[:, 1:]))

    # ------------------------------------------------------------------ pair scoring
    # caption_scoring's PairScorer (see AdaptiveAttentionDecoder): the LSTM's input projection runs
    # once per caption token (as nn.LSTM does over a sequence on the CPU), not once per pair.

    def pair_state(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[State, State]:
        state = self.init_state(features, mask)
        return {}, {"h": state["h"][:, None], "c": state["c"][:, None]}

    def pair_words(self, tokens: torch.Tensor) -> State:
        return {"gates": nn.functional.linear(self.embed(tokens[:, :-1]), self.lstm.weight_ih_l0, self.lstm.bias_ih_l0)}

    def pair_step(self, words: State, images: State, carry: State) -> tuple[torch.Tensor, State]:
        gates = nn.functional.linear(carry["h"], self.lstm.weight_hh_l0, self.lstm.bias_hh_l0) + words["gates"][None]
        h, c = lstm_update(gates, carry["c"])
        return self.out(self.dropout(h)), {"h": h, "c": c}
