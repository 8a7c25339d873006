"""ln p(caption | image) for every caption against every image: self-retrieval's score matrix.

C x N pairs, each a teacher-forced pass through the decoder: the cost is the pairs' steps, so
each pair's step does only the work that depends on both its caption and its image:

- A decoder that implements `PairScorer` (the captioners) splits its step: what depends on the
  image alone is computed once per image (`pair_state`), what depends on the word alone once per
  caption token (`pair_words`), and `pair_step` adds them up for k caption prefixes x N images at
  once. Any other `StepDecoder` runs its `step` on the pairs' rows (`StepsOverPairs`).
- Captions that begin alike are stepped once per image: a teacher-forced step depends on the image
  and the caption's prefix only, so the captions' prefixes form a tree (`PrefixTree`), each distinct
  prefix is one step, and each caption reads its words' log-probabilities off its own path. Beam
  search repeats itself (an untrained captioner's 500 test captions on the demo share 40% of their
  steps; trained ones start alike more often), and the sum over a caption's steps is the sum the
  caption would take alone.
- ln p(target) = logit[target] - logsumexp(logits): no (pairs, V) log-softmax is written.
- Images are taken a block at a time, of ~2048 pairs at the tree's widest depth: the attention's
  (pairs, regions, hidden) temporaries stay in the cache (on the captioner demo's untrained
  captions, 1024, 4096 and 8192 pairs were each slower).
- Self-retrieval needs each caption's rank only, so a pair that can no longer outscore the
  caption's own image is dropped (`self_retrieval_logprobs`): a sentence's log-probability only
  falls as its words are added, so once a prefix's running sum on an image is below what the
  caption scores on its own image, the caption ends below it there too. A prefix is stepped for a
  block of images while any of them is still above, and what is dropped comes back as -inf: the
  ranks, and so the recalls, are those of the whole matrix.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from vldist.models.generation import State, StepDecoder, sequence_logprob


class PairScorer(Protocol):
    """Teacher forcing of k caption prefixes against N images, laid out (N, k, .): image-major, so
    that a decoder's (B, T, .) code can read it as N images x k steps."""

    def pair_state(self, features: Tensor, mask: Tensor) -> tuple[State, State]:
        """(per image (N, .) entries every step reads, the recurrent state before <start> (N, 1, .))."""

    def pair_words(self, tokens: Tensor) -> State:
        """Per caption and input position (C, T-1, .): the words' share of each step."""

    def pair_step(self, words: State, images: State, carry: State) -> tuple[Tensor, State]:
        """One step of k prefixes (`words` rows (k, .), each prefix's last word) x N images, from
        `carry` (N, k, .), each prefix's state before its last word: (logits (N, k, V), carry (N, k, .))."""


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


class PrefixTree:
    """The distinct prefixes of padded token rows (C, T), depth by depth: at depth t, the prefixes
    tokens[c, : t + 1] of the captions that have a word to predict after them (tokens[c, t + 1] is
    not padding). Per depth: `parents` (nodes,) the parent's index at depth t - 1 (0 at depth 0,
    where the nodes' carry is the start state), `rows` (nodes,) a caption that has the node (whose
    word state at t is the node's input), and the captions predicting there: `captions` (k,), their
    node `nodes` (k,) and the `targets` (k,) they predict."""

    def __init__(self, tokens: Tensor, pad_id: int):
        self.depths: list[dict[str, Tensor]] = []
        node_of_caption = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        base = int(tokens.max()) + 1 if tokens.numel() else 1
        for t in range(tokens.shape[1] - 1):
            captions = (tokens[:, t + 1] != pad_id).nonzero().squeeze(1)
            if captions.numel() == 0:
                break  # padding only after a caption's end: no caption predicts at a later depth
            # a node is (its parent, its word): the same pair is the same prefix
            keys = node_of_caption[captions] * base + tokens[captions, t]
            distinct, nodes = torch.unique(keys, return_inverse=True)
            rows = torch.empty_like(distinct).scatter_(0, nodes, captions)
            self.depths.append(
                {
                    "parents": distinct // base,
                    "rows": rows,
                    "captions": captions,
                    "nodes": nodes,
                    "targets": tokens[captions, t + 1],
                }
            )
            node_of_caption[captions] = nodes

    @property
    def widest(self) -> int:
        return max((len(depth["parents"]) for depth in self.depths), default=0)


@torch.no_grad()
def caption_image_logprobs(
    decoder,
    features: Tensor,
    mask: Tensor,
    tokens: Tensor,
    pad_id: int = 0,
    pairs_per_chunk: int = 2048,
    floor: Tensor | None = None,
) -> Tensor:
    """(C, N) float32 matrix of sentence log-probabilities (end token included): entry [c, n] is
    ln p(tokens[c] | image n). `tokens` (C, T) start with <start> and are padded with `pad_id`
    (after their end only). A step holds about `pairs_per_chunk` pairs (at least one image).

    floor (C,), optional: entry [c, n] is -inf instead where ln p(tokens[c] | image n) < floor[c]
    is known before its last word; a prefix is no longer stepped for a block of images once its
    running sum is below every floor of the captions that share it, on every image of the block."""
    scorer = pair_scorer(decoder)
    images, start = scorer.pair_state(features, mask)
    n_captions, n_images = tokens.shape[0], features.shape[0]
    out = torch.zeros(n_captions, n_images, dtype=torch.float32)
    tree = PrefixTree(tokens, pad_id)
    if not tree.depths:  # no captions, or none with a word after <start>
        return out  # nothing to predict: ln p of no words is 0
    words = scorer.pair_words(tokens)
    # each node's floor: the lowest of its captions', so a node is dropped only when all of them may drop it
    node_floors = [None if floor is None else _lowest_per_node(floor.to(tokens.device), depth) for depth in tree.depths]
    block = max(1, pairs_per_chunk // tree.widest)
    for first in range(0, n_images, block):
        these = slice(first, min(first + block, n_images))
        block_images = {name: value[these] for name, value in images.items()}
        carry = {name: value[these] for name, value in start.items()}
        total = torch.zeros(these.stop - first, n_captions, dtype=torch.float32, device=tokens.device)
        carried = None  # depth t - 1's nodes: their column in `carry`, -1 where not stepped; None: all stepped
        for t, (depth, node_floor) in enumerate(zip(tree.depths, node_floors, strict=True)):
            stepped = _stepped_nodes(depth, total, node_floor, carried)  # None: every node
            if stepped is not None and not len(stepped):  # every prefix dropped: so is every caption still running
                total[:, depth["captions"]] = float("-inf")
                break
            parents, rows = (
                (depth["parents"], depth["rows"])
                if stepped is None
                else (depth["parents"][stepped], depth["rows"][stepped])
            )
            columns = parents if carried is None else carried[parents]  # at depth 0: the start state's one column
            carry = {name: value.index_select(1, columns) for name, value in carry.items()}
            logits, carry = scorer.pair_step(
                {name: value[rows, t] for name, value in words.items()}, block_images, carry
            )
            logits = logits.float()
            captions, column, targets = depth["captions"], depth["nodes"], depth["targets"]
            carried = None
            if stepped is not None:  # the captions of dropped nodes are dropped; the others read their node's column
                carried = torch.full_like(depth["parents"], -1)
                carried[stepped] = torch.arange(len(stepped), device=stepped.device)
                column = carried[column]
                live = column >= 0
                total[:, captions[~live]] = float("-inf")
                captions, column, targets = captions[live], column[live], targets[live]
            total[:, captions] += logits[:, column, targets] - logits.logsumexp(dim=-1)[:, column]
        out[:, these] = total.T.cpu()
    return out


def _lowest_per_node(floor: Tensor, depth: dict[str, Tensor]) -> Tensor:
    lowest = torch.full(depth["parents"].shape, float("inf"), device=floor.device)
    return lowest.scatter_reduce(0, depth["nodes"], floor[depth["captions"]], "amin")


def _stepped_nodes(depth: dict[str, Tensor], total: Tensor, node_floor: Tensor | None, carried) -> Tensor | None:
    """The depth's nodes to step for this block of images, None for all of them (no floors, or
    none reached): those whose running sum (shared by their captions: `total` at the node's row)
    is not below the node's floor on some image of the block, and whose parent was stepped."""
    if node_floor is None:
        return None
    keep = ~(total[:, depth["rows"]] < node_floor).all(dim=0)  # a NaN sum is never below: it stays to be seen
    if carried is not None:
        keep &= carried[depth["parents"]] >= 0
    return None if bool(keep.all()) else keep.nonzero().squeeze(1)


@torch.no_grad()
def own_image_logprobs(decoder, features: Tensor, mask: Tensor, tokens: Tensor, pad_id: int = 0) -> Tensor:
    """(C,) ln p(tokens[c] | image c), C = N: each caption against its own image, through the
    decoder's generation `step` (every StepDecoder has one), a word at a time so that no
    (C, T, V) logits are held."""
    state = decoder.init_state(features, mask)
    total = torch.zeros(tokens.shape[0], dtype=torch.float32, device=tokens.device)
    for t in range(tokens.shape[1] - 1):
        targets = tokens[:, t + 1 : t + 2]
        if (targets == pad_id).all():
            break
        logits, state = decoder.step(tokens[:, t], state)
        total += sequence_logprob(logits[:, None], targets, pad_id)
    return total.cpu()


def self_retrieval_logprobs(
    decoder, features: Tensor, mask: Tensor, tokens: Tensor, pad_id: int = 0, pairs_per_chunk: int = 2048
) -> Tensor:
    """`caption_image_logprobs` for self-retrieval, where caption c was generated from image c:
    an entry known before its caption's last word to end below the caption's own image is -inf,
    so each caption's rank among the images (and every recall@K) is that of the whole matrix. The
    floors are the own images' scores less a slack for the two computations' rounding (1e-3 of
    the score, and 1e-3); a NaN score is a floor no sum is below, so the matrix shows the NaN."""
    own = own_image_logprobs(decoder, features, mask, tokens, pad_id)
    floor = own - 1e-3 * (1 + own.abs())
    return caption_image_logprobs(decoder, features, mask, tokens, pad_id, pairs_per_chunk, floor)
