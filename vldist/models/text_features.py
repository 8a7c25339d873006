"""Fixed-size sentence features for the two-branch networks' text branch.

The two-branch networks paper (Wang, Li, Lazebnik) feeds each sentence to its text branch as an
HGLMM Fisher vector of word2vec vectors. Those features need the authors' GMM/HGLMM fits and
pre-trained word vectors, which are not available offline; the paper reports that tf-idf-like
sentence features come close. So there are two featurizers, both nn.Modules that take the token
ids as the platform encodes them (`Vocab.encode` -> `pad_tokens`: `<start> words <end>`, padded
with 0) and run batched on the GPU:

* `TfidfTextFeatures` ("tfidf"): the substitute for the Fisher vectors. Its idf weights are fitted
  once by scikit-learn's `TfidfVectorizer` on the train split's captions (`fit`) and kept as the
  persistent `idf` buffer, so they are saved in the checkpoint's model.safetensors with the rest
  of the weights. Evaluation and a user's own sentences then get exactly the features of training
  with no scikit-learn state and no pickles (scikit-learn is needed to fit, never to run).
* `MeanWordTextFeatures` ("mean_words"): a learned word embedding averaged over the words of the
  sentence, a trainable alternative when no fit over the captions is wanted.

`text_features(kind, vocab_size, dim)` builds either by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vldist.data.vocab import SPECIALS, Vocab, tokenize
from vldist.models.common import l2norm

KINDS = ("tfidf", "mean_words")
_FIRST_WORD = len(SPECIALS)  # ids 0-3 are <pad>, <start>, <end>, <unk>


def _valid(tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """(B, L) True for positions inside each row's length (all of them when lengths is None)."""
    if lengths is None:
        return torch.ones_like(tokens, dtype=torch.bool)
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return positions.unsqueeze(0) < lengths.to(tokens.device).unsqueeze(1)


class TfidfTextFeatures(nn.Module):
    """tokens (B, L) -> (B, vocab_size) l2-normalised tf-idf vectors, equal to scikit-learn's
    `TfidfVectorizer(...).transform(captions)` for the vectorizer that `fit` used (raw term
    counts, smooth idf, l2 norm).

    <pad>, <start>, <end> and <unk> have weight 0: unknown words count for nothing, as words
    outside a fixed vocabulary do in scikit-learn. A row with no known word is all zeros. Before
    `fit` (or loading a fitted state dict) every output is zeros. Captions truncated by
    `Vocab.encode(max_len=...)` lose the words past the cut, so their features differ from
    scikit-learn's on the full caption.
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        if vocab_size <= _FIRST_WORD:
            raise ValueError(f"vocab_size must exceed the {_FIRST_WORD} special ids, got {vocab_size}")
        self.out_dim = vocab_size
        self.register_buffer("idf", torch.zeros(vocab_size, dtype=torch.float32), persistent=True)

    @property
    def fitted(self) -> bool:
        return bool(self.idf.any())

    @torch.no_grad()
    def fit(self, vocab: Vocab, captions: Iterable[str]) -> TfidfTextFeatures:
        """Fit the idf weights on `captions` (the train split's) with scikit-learn, over `vocab`'s
        words, and store them in the `idf` buffer at the words' ids. Returns self."""
        if len(vocab) > self.out_dim:
            raise ValueError(f"the vocabulary has {len(vocab)} ids but the features were built for {self.out_dim}")
        captions = list(captions)
        if not captions:
            raise ValueError("cannot fit the tf-idf features on no captions")
        try:
            from sklearn.feature_extraction.text import TfidfVectorizer
        except ImportError as err:
            raise ImportError(
                "fitting the tf-idf sentence features needs scikit-learn (pip install scikit-learn); "
                "a checkpoint that already holds the fitted idf loads without it"
            ) from err
        # the real words in id order; a word listed twice maps to its last id, as Vocab.stoi does
        words = list(dict.fromkeys(vocab.itos[_FIRST_WORD:]))
        ids = torch.tensor([vocab.stoi[w] for w in words], dtype=torch.long)
        vectorizer = TfidfVectorizer(vocabulary=words, tokenizer=tokenize, lowercase=False, token_pattern=None)
        vectorizer.fit(captions)
        idf = torch.zeros_like(self.idf)
        idf[ids.to(idf.device)] = torch.as_tensor(vectorizer.idf_, dtype=idf.dtype, device=idf.device)
        self.idf.copy_(idf)
        return self

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, L) long padded ids (lengths (B,) optional; padding is ignored either way)
        -> (B, vocab_size) float32."""
        words = (tokens >= _FIRST_WORD) & _valid(tokens, lengths)
        counts = torch.zeros(tokens.shape[0], self.out_dim, dtype=self.idf.dtype, device=tokens.device)
        counts.scatter_add_(1, tokens, words.to(counts.dtype))
        return l2norm(counts * self.idf)  # a zero row stays zero (the norm is clamped)


class MeanWordTextFeatures(nn.Module):
    """tokens (B, L) -> (B, dim): the mean of learned word vectors over each row's words.

    <pad>, <start> and <end> are skipped; <unk> counts as a word (it has its own vector). A row
    with no word gives zeros. Only the rows of the words used receive gradient.
    """

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.out_dim = dim
        self.embed = nn.EmbeddingBag(vocab_size, dim, mode="sum")
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)  # as the GRU text encoder's embeddings

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, L) long padded ids (lengths (B,) optional) -> (B, dim)."""
        words = (tokens > Vocab.end_id) & _valid(tokens, lengths)
        weights = words.to(self.embed.weight.dtype)
        weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=1.0)
        return self.embed(tokens, per_sample_weights=weights)


def text_features(kind: str, vocab_size: int, dim: int) -> nn.Module:
    """ "tfidf" -> TfidfTextFeatures(vocab_size) (out_dim = vocab_size; `dim` is unused and it needs
    `fit`), "mean_words" -> MeanWordTextFeatures(vocab_size, dim)."""
    if kind == "tfidf":
        return TfidfTextFeatures(vocab_size)
    if kind == "mean_words":
        return MeanWordTextFeatures(vocab_size, dim)
    raise ValueError(f"unknown text features {kind!r}; choose one of {', '.join(KINDS)}")
