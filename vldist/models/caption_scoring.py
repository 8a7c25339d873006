"""ln p(caption | image) for every caption against every image: self-retrieval's score matrix.

C x N pairs, each a teacher-forced pass through the decoder: the cost is the pairs' steps, so
each pair's step does only the work that depends on both its caption and its image:

- A decoder that implements `PairScorer` (the captioners) splits its step: what depends on the
  image alone is computed once per image (`pair_state`), what depends on the word alone once per
  caption token (`pair_words`), and `pair_step` adds them up for k captions x N images at once.
  Any other `StepDecoder` runs its `step` on the pairs' rows (`StepsOverPairs`).
- Captions are sorted by length and scored k at a time against all N images, so a group's steps
  stop at its own longest caption, not the longest of all.
- ln p(target) = logit[target] - logsumexp(logits): no (pairs, V) log-softmax is written.
- Chunks of ~2048 pairs: the attention's (pairs, regions, hidden) temporaries stay in the cache
  (on the captioner demo, 8192 was slower than 2048 and 4096, which tied).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from vldist.models.generation import State, StepDecoder


class PairScorer(Protocol):
    """Teacher forcing of k captions against N images, laid out (N, k, .): image-major, so that a
    decoder's (B, T, .) code can read it as N images x k steps."""

    def pair_state(self, features: Tensor, mask: Tensor) -> tuple[State, State]:
        """(per image (N, .) entries every step reads, the recurrent state before <start> (N, 1, .))."""

    def pair_words(self, tokens: Tensor) -> State:
        """Per caption and input position (C, T-1, .): the words' share of each step."""

    def pair_step(self, words: State, images: State, carry: State) -> tuple[Tensor, State]:
        """One step of k captions (`words` rows (k, .)) x N images: (logits (N, k, V), carry (N, k, .)).
        `carry` is (N, 1, .) at the first step, broadcast over the captions."""


class StepsOverPairs:
    """PairScorer of any StepDecoder: each pair is a row of `step`'s batch."""

    def __init__(self, decoder: StepDecoder):
        self.decoder = decoder

    def pair_state(self, features: Tensor, mask: Tensor) -> tuple[State, State]:
        return {}, {name: value[:, None] for name, value in self.decoder.init_state(features, mask).items()}

    def pair_words(self, tokens: Tensor) -> State:
        return {"words": tokens[:, :-1]}

    def pair_step(self, words: State, images: State, carry: State) -> tuple[Tensor, State]:
        n_images, k = next(iter(carry.values())).shape[0], words["words"].shape[0]

        def rows(value: Tensor) -> Tensor:
            return value.expand(n_images, k, *value.shape[2:]).reshape(n_images * k, *value.shape[2:])

        word = words["words"][None].expand(n_images, k).reshape(-1)
        logits, state = self.decoder.step(word, {name: rows(value) for name, value in carry.items()})
        pairs = {name: value.reshape(n_images, k, *value.shape[1:]) for name, value in state.items()}
        return logits.reshape(n_images, k, logits.shape[-1]), pairs


def pair_scorer(decoder) -> PairScorer:
    return decoder if hasattr(decoder, "pair_step") else StepsOverPairs(decoder)


@torch.no_grad()
def caption_image_logprobs(
    decoder, features: Tensor, mask: Tensor, tokens: Tensor, pad_id: int = 0, pairs_per_chunk: int = 2048
) -> Tensor:
    """(C, N) float32 matrix of sentence log-probabilities (end token included): entry [c, n] is
    ln p(tokens[c] | image n). `tokens` (C, T) start with <start> and are padded with `pad_id`
    (after their end only). A chunk holds about `pairs_per_chunk` pairs (at least one caption)."""
    scorer = pair_scorer(decoder)
    images, start = scorer.pair_state(features, mask)
    n_captions, n_images = tokens.shape[0], features.shape[0]
    lengths = (tokens != pad_id).sum(dim=1)
    # Longest first: each group's captions are of about one length, and the group runs to its longest.
    order = lengths.argsort(descending=True, stable=True)
    out = torch.empty(n_captions, n_images, dtype=torch.float32)
    if n_captions == 0:
        return out  # split would yield one empty group
    for group in order.split(max(1, pairs_per_chunk // max(1, n_images))):
        group_tokens = tokens[group, : int(lengths[group[0]])]  # no steps over padding only
        group_words, targets = scorer.pair_words(group_tokens), group_tokens[:, 1:]
        total = torch.zeros(n_images, len(group), dtype=torch.float32, device=tokens.device)
        carry = start
        for t in range(targets.shape[1]):
            logits, carry = scorer.pair_step({name: value[:, t] for name, value in group_words.items()}, images, carry)
            logits = logits.float()
            target = targets[:, t]
            picked = logits.gather(-1, target.expand(n_images, -1)[..., None]).squeeze(-1)
            total += (picked - logits.logsumexp(dim=-1)).masked_fill(target == pad_id, 0.0)
        out[group.cpu()] = total.T.cpu()
    return out
