"""The two-branch networks' sentence featurizers: tf-idf (fitted by scikit-learn, stored as a buffer)
and the mean of learned word vectors."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vldist.data.collate import pad_tokens
from vldist.data.vocab import Vocab, tokenize
from vldist.models.text_features import (
    KINDS,
    MeanWordTextFeatures,
    TfidfTextFeatures,
    text_features,
)

TRAIN = [
    "A man rides a horse on the beach.",
    "Two dogs play with a ball in the park",
    "A woman is riding a bike down the street.",
    "A dog runs on the beach with a ball!",
    "The man and the woman walk the dog in the park.",
    "A horse stands in a field.",
]
# repeated words, words outside the vocabulary (unseen, or seen once with min_count=2), an
# all-unknown caption, and an empty one
TEST = [
    "a dog a dog a DOG on the beach",
    "the zebra plays the ukulele in the park",
    "Riding a horse, a man, on the beach",
    "zebra ukulele xylophone",
    "",
    "two dogs ball ball ball field",
]


def _vocab():
    return Vocab.build(TRAIN, min_count=2)


def _encode(vocab, captions, length=None):
    return pad_tokens([vocab.encode(c) for c in captions], length=length)


def _sklearn_features(vocab, vocab_size, train, test):
    """scikit-learn's tf-idf of `test`, fitted on `train`, put in the columns of the vocab ids."""
    text = pytest.importorskip("sklearn.feature_extraction.text")
    words = vocab.itos[4:]
    vectorizer = text.TfidfVectorizer(vocabulary=words, tokenizer=tokenize, lowercase=False, token_pattern=None)
    vectorizer.fit(train)
    expected = np.zeros((len(test), vocab_size))
    expected[:, [vocab.stoi[w] for w in words]] = vectorizer.transform(test).toarray()
    idf = np.zeros(vocab_size)
    idf[[vocab.stoi[w] for w in words]] = vectorizer.idf_
    return expected, idf


@pytest.mark.parametrize("extra", [0, 3])
def test_tfidf_equals_sklearn_transform(extra):
    pytest.importorskip("sklearn")
    vocab = _vocab()
    size = len(vocab) + extra  # ids past the vocabulary get no weight
    features = TfidfTextFeatures(size).fit(vocab, TRAIN)
    expected, idf = _sklearn_features(vocab, size, TRAIN, TEST)

    tokens, lengths = _encode(vocab, TEST)
    out = features(tokens, lengths)

    assert out.shape == (len(TEST), size) and out.dtype == torch.float32
    assert features.out_dim == size
    np.testing.assert_allclose(features.idf.numpy(), idf, rtol=1e-6)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.isnan(out).any()
    # the all-unknown and empty captions give zero rows; the others unit vectors
    norms = out.norm(dim=1)
    assert torch.all(norms[[3, 4]] == 0)
    torch.testing.assert_close(norms[[0, 1, 2, 5]], torch.ones(4))


def test_tfidf_ignores_padding_specials_and_lengths():
    pytest.importorskip("sklearn")
    vocab = _vocab()
    features = TfidfTextFeatures(len(vocab)).fit(vocab, TRAIN)
    assert torch.all(features.idf[:4] == 0)

    tokens, lengths = _encode(vocab, TEST)
    base = features(tokens)
    padded, _ = _encode(vocab, TEST, length=tokens.shape[1] + 5)
    torch.testing.assert_close(features(padded), base)
    torch.testing.assert_close(features(tokens, lengths), base)

    # specials sprinkled into a sentence change nothing
    ids = vocab.encode(TEST[0])
    noisy = [ids[0], vocab.unk_id, *ids[1:3], vocab.start_id, vocab.pad_id, *ids[3:-1], vocab.unk_id, ids[-1]]
    torch.testing.assert_close(features(torch.tensor([noisy])), base[:1])

    # words past a row's length are not counted
    cut = features(tokens, torch.full_like(lengths, 3))
    torch.testing.assert_close(cut, features(tokens[:, :3]))


def test_tfidf_unfitted_gives_zeros_and_fit_needs_room():
    vocab = _vocab()
    features = TfidfTextFeatures(len(vocab))
    assert not features.fitted
    out = features(_encode(vocab, TEST)[0])
    assert torch.all(out == 0)

    with pytest.raises(ValueError, match="vocabulary"):
        TfidfTextFeatures(len(vocab) - 1).fit(vocab, TRAIN)
    pytest.importorskip("sklearn")
    assert features.fit(vocab, TRAIN) is features and features.fitted


def test_tfidf_idf_travels_in_the_safetensors_weights(tmp_path):
    pytest.importorskip("sklearn")
    vocab = _vocab()
    fitted = TfidfTextFeatures(len(vocab)).fit(vocab, TRAIN)
    state = fitted.state_dict()
    assert list(state) == ["idf"]
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")

    restored = TfidfTextFeatures(len(vocab))
    restored.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert restored.fitted
    tokens, lengths = _encode(vocab, TEST)
    torch.testing.assert_close(restored(tokens, lengths), fitted(tokens, lengths))


def _loop_mean(weight, rows):
    out = torch.zeros(len(rows), weight.shape[1])
    for i, ids in enumerate(rows):
        words = [t for t in ids if t not in (0, 1, 2)]  # <unk> (3) counts as a word
        if words:
            out[i] = torch.stack([weight[t] for t in words]).mean(dim=0)
    return out


def test_mean_words_equals_loop_and_grads_only_used_rows():
    vocab = _vocab()
    rows = [vocab.encode(c) for c in TEST]  # includes <unk>, repeats, an empty caption
    rows.append([vocab.start_id, vocab.end_id])
    tokens, lengths = pad_tokens(rows, length=max(map(len, rows)) + 2)
    torch.manual_seed(0)
    model = MeanWordTextFeatures(len(vocab), 8)
    assert model.out_dim == 8

    out = model(tokens, lengths)
    torch.testing.assert_close(out, _loop_mean(model.embed.weight.detach(), rows))
    torch.testing.assert_close(model(tokens), out)
    assert torch.all(out[4] == 0) and torch.all(out[-1] == 0)

    out.sum().backward()
    grad = model.embed.weight.grad
    used = {t for ids in rows for t in ids if t > 2}
    for i in range(len(vocab)):
        assert bool(grad[i].abs().sum() > 0) == (i in used), i


def test_factory_builds_both_and_rejects_others():
    assert KINDS == ("tfidf", "mean_words")
    tfidf = text_features("tfidf", 20, 8)
    assert isinstance(tfidf, TfidfTextFeatures) and tfidf.out_dim == 20
    mean = text_features("mean_words", 20, 8)
    assert isinstance(mean, MeanWordTextFeatures) and mean.out_dim == 8
    with pytest.raises(ValueError, match="tfidf.*mean_words"):
        text_features("fisher", 20, 8)
