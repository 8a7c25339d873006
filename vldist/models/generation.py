"""Caption decoding shared by every recipe with a decoder: greedy, beam search, sentence log-probs.

A decoder that can generate follows the step protocol (`StepDecoder`):

- ``init_state(features (B, R, F), mask (B, R) bool) -> dict[str, Tensor]``: the decoding state
  before ``<start>`` is read. Every tensor in it is batch-first (dim 0 = B), so that a search can
  repeat and reorder hypotheses with ``repeat_interleave``/``index_select`` along dim 0. It holds
  whatever per-image context the step needs (e.g. the projected region keys and the mask).
- ``step(words (B,) long, state) -> (logits (B, V), new_state)``: reads one word per row. It
  passes the entries it does not change through as the same tensor objects and modifies no state
  tensor in place (beam search relies on it: see `_reorder_beams`).
- ``forward(features, mask, tokens (B, T)) -> logits (B, T-1, V)``: teacher forcing, predicting
  ``tokens[:, 1:]`` from ``tokens[:, :-1]``; equal to running ``step`` over the tokens.

Decoded captions are (B, L) word ids after ``<start>``: the end token included when produced, then
the pad id 0 for captions that ended earlier; L <= max_len.

Stopping early needs the host to read a flag off the device, which on CUDA waits for every queued
kernel. The searches therefore read it only every ``sync_every`` steps (default: every step on the
CPU, where the read is free; every 4 on an accelerator). The steps run past the stopping point
change nothing: greedy's extra columns are padding and are cut; beam search freezes its scores and
hypotheses from the step where the per-step check would have stopped. Outputs are identical for
any ``sync_every``; only the decoder's step count differs.
"""

from __future__ import annotations

from typing import Protocol

import torch

PAD_ID = 0  # vldist.data.vocab.Vocab.pad_id

State = dict[str, torch.Tensor]


class StepDecoder(Protocol):
    training: bool

    def init_state(self, features: torch.Tensor, mask: torch.Tensor) -> State: ...

    def step(self, words: torch.Tensor, state: State) -> tuple[torch.Tensor, State]: ...

    def train(self, mode: bool = True): ...


def _reorder(state: State, index: torch.Tensor) -> State:
    return {name: value.index_select(0, index) for name, value in state.items()}


def _reorder_beams(state: State, rows: torch.Tensor, same_per_image: set[str]) -> State:
    """The beam's state reordered by `rows`, which stay within each image's beams. The entries in
    `same_per_image` hold their image's rows, identical across its beams, so reordering them would
    copy them onto themselves: they are kept as they are (at the paper's sizes, the region
    features and keys (B * k, R, F) are not copied at every step)."""
    return {name: value if name in same_per_image else value.index_select(0, rows) for name, value in state.items()}


def _words_only(scores: torch.Tensor, start_id: int) -> torch.Tensor:
    """Scores with <pad> and <start> ruled out: training never targets them, so an untrained
    model could otherwise emit them mid-caption."""
    scores = scores.clone()
    # Two scalar fills: an index list would be copied to the device at every step.
    scores[:, PAD_ID] = float("-inf")
    scores[:, start_id] = float("-inf")
    return scores


def default_sync_every(device: torch.device) -> int:
    """Steps between the host's reads of the stop flag: every step where reading it is free."""
    return 1 if device.type == "cpu" else 4


def _checks(max_len: int, sync_every: int | None, device: torch.device):
    """For each step, whether the host reads the stop flag after it."""
    every = default_sync_every(device) if sync_every is None else sync_every
    if every < 1:
        raise ValueError(f"sync_every must be at least 1, got {every}")
    return ((step + 1) % every == 0 for step in range(max_len))


def greedy_decode(
    decoder: StepDecoder,
    features: torch.Tensor,
    mask: torch.Tensor,
    start_id: int,
    end_id: int,
    max_len: int,
    sync_every: int | None = None,
) -> torch.Tensor:
    """The most likely next word at each step; stops once every caption has ended."""
    state = decoder.init_state(features, mask)
    word = torch.full((features.shape[0],), start_id, dtype=torch.long, device=features.device)
    ended = torch.zeros_like(word, dtype=torch.bool)
    # Steps until every caption had ended: the output's length, counted on the device.
    length = torch.zeros((), dtype=torch.long, device=features.device)
    words = []
    for check in _checks(max_len, sync_every, features.device):
        length += ~ended.all()
        logits, state = decoder.step(word, state)
        word = _words_only(logits, start_id).argmax(dim=-1).masked_fill(ended, PAD_ID)
        words.append(word)
        ended |= word == end_id
        if check and bool(ended.all()):
            break
    if not words:
        return word.new_zeros((word.shape[0], 0))
    # An empty batch has "all ended" from the start, yet took one step.
    return torch.stack(words, dim=1)[:, : max(int(length), 1)]


def beam_search(
    decoder: StepDecoder,
    features: torch.Tensor,
    mask: torch.Tensor,
    start_id: int,
    end_id: int,
    max_len: int,
    beam_size: int = 3,
    sync_every: int | None = None,
) -> torch.Tensor:
    """The finished hypothesis with the highest total log-probability per image (no length norm).

    All B * beam_size hypotheses step together. A finished hypothesis stays in the beam with its
    score, extended only by padding at log-probability 0; one still open at max_len counts as
    finished. Search stops early once no open hypothesis can overtake the best finished one.
    """
    batch, k, device = features.shape[0], beam_size, features.device
    state = _reorder(decoder.init_state(features, mask), torch.arange(batch, device=device).repeat_interleave(k))
    # Entries every step so far has passed through: still the per-image rows repeated k times.
    same_per_image = set(state)
    word = torch.full((batch * k,), start_id, dtype=torch.long, device=device)
    # Only the first beam is live at the start, so the first step does not fill the beam with k
    # copies of one hypothesis.
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    # Per hypothesis (row b * k + j): its words, whether it has ended, its length up to the end.
    tokens = word.new_zeros((batch * k, 0))
    finished = torch.zeros(batch * k, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch * k, dtype=torch.long, device=device)
    first_row = torch.arange(batch, device=device)[:, None] * k
    own_rows = torch.arange(batch * k, device=device)
    # Set on the device at the step where the search is over; later steps (run only until the host
    # next reads it) keep every result as it was then.
    stopped = torch.zeros((), dtype=torch.bool, device=device)
    pad_only = None
    for check in _checks(max_len, sync_every, device):
        logits, new_state = decoder.step(word, state)
        logprobs = _words_only(logits.float().log_softmax(dim=-1), start_id)
        vocab = logprobs.shape[-1]
        if pad_only is None:
            # A finished hypothesis has one continuation, padding, that keeps its score.
            pad_only = torch.full_like(logprobs[0], float("-inf"))
            pad_only[PAD_ID] = 0.0
        logprobs = torch.where(finished[:, None], pad_only, logprobs)
        candidates = scores[..., None] + logprobs.view(batch, k, vocab)
        new_scores, flat = candidates.view(batch, k * vocab).topk(k, dim=-1)
        scores = torch.where(stopped, scores, new_scores)
        rows = torch.where(stopped, own_rows, (first_row + flat // vocab).view(-1))
        word = torch.where(stopped, PAD_ID, (flat % vocab).view(-1))
        same_per_image = {name for name in same_per_image if new_state.get(name) is state[name]}
        state = _reorder_beams(new_state, rows, same_per_image)
        tokens = torch.cat([tokens[rows], word[:, None]], dim=1)
        lengths = lengths[rows] + (~(finished[rows] | stopped)).long()
        finished = finished[rows] | (word == end_id)
        # Log-probs are <= 0, so an open hypothesis only loses score: once every image's best
        # finished one scores at least its best open one, more steps cannot change the result.
        done = finished.view(batch, k)
        best_done = scores.masked_fill(~done, float("-inf")).amax(dim=-1)
        best_open = scores.masked_fill(done, float("-inf")).amax(dim=-1)
        stopped = stopped | (best_done >= best_open).all()
        if check and bool(stopped):
            break
    best = first_row.view(-1) + scores.argmax(dim=-1)
    return tokens[best][:, : int(lengths[best].max()) if batch else 0]


def generate(
    decoder: StepDecoder,
    features: torch.Tensor,
    mask: torch.Tensor,
    start_id: int,
    end_id: int,
    max_len: int,
    beam_size: int = 3,
    sync_every: int | None = None,
) -> torch.Tensor:
    """Greedy (beam_size 1) or beam search, without gradients and in eval mode (dropout off).

    The decoder's train/eval mode is restored afterwards. ``sync_every``: see the module's doc.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")
    was_training = decoder.training
    decoder.train(False)
    try:
        with torch.no_grad():
            if beam_size == 1:
                return greedy_decode(decoder, features, mask, start_id, end_id, max_len, sync_every)
            return beam_search(decoder, features, mask, start_id, end_id, max_len, beam_size, sync_every)
    finally:
        decoder.train(was_training)


def sequence_logprob(logits: torch.Tensor, targets: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """ln p(c | I) per caption (B,): log-softmax at each non-pad target, summed (end token included).

    Float32 even under bf16 autocast: sums over ~20 tokens lose too much in bf16.
    """
    with torch.autocast(device_type=logits.device.type, enabled=False):
        logprobs = logits.float().log_softmax(dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(targets != pad_id, logprobs, torch.zeros_like(logprobs)).sum(dim=-1)
