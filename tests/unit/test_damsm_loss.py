"""DAMSM (vldist/losses/damsm.py) against AttnGAN's `words_loss`, `sent_loss` and `func_attention`
transcribed literally below: a loop over captions, each caption's real words repeated over the
batch, two softmaxes, cosine, log-sum-exp, then nn.CrossEntropyLoss both ways."""

import pytest
import torch
from torch import nn

from vldist.losses import damsm as damsm_module
from vldist.losses.damsm import (
    PARTS,
    cross_rank_damsm_loss,
    cross_rank_damsm_parts,
    damsm_loss,
    damsm_parts,
    word_region_scores,
)

B, T, H, W, D = 5, 7, 2, 3, 8  # regions on a 2 x 3 grid: R = 6
LENGTHS = [3, 7, 1, 5, 2]


# --- AttnGAN (misc/losses.py and GlobalAttention.py), layouts and all ------------------------------


def attngan_cosine_similarity(x1, x2, dim=1, eps=1e-8):
    w12 = torch.sum(x1 * x2, dim)
    w1 = torch.norm(x1, 2, dim)
    w2 = torch.norm(x2, 2, dim)
    return (w12 / (w1 * w2).clamp(min=eps)).squeeze()


def attngan_func_attention(query, context, gamma1):
    """query: batch x ndf x queryL; context: batch x ndf x ih x iw."""
    batch_size, query_len = query.size(0), query.size(2)
    ih, iw = context.size(2), context.size(3)
    source_len = ih * iw
    context = context.view(batch_size, -1, source_len)
    context_t = torch.transpose(context, 1, 2).contiguous()
    attn = torch.bmm(context_t, query)  # batch x sourceL x queryL
    attn = attn.view(batch_size * source_len, query_len)
    attn = nn.Softmax(dim=1)(attn)  # over the words
    attn = attn.view(batch_size, source_len, query_len)
    attn = torch.transpose(attn, 1, 2).contiguous()
    attn = attn.view(batch_size * query_len, source_len)
    attn = attn * gamma1
    attn = nn.Softmax(dim=1)(attn)  # over the regions
    attn = attn.view(batch_size, query_len, source_len)
    attn_t = torch.transpose(attn, 1, 2).contiguous()
    weighted_context = torch.bmm(context, attn_t)  # batch x ndf x queryL
    return weighted_context, attn.view(batch_size, -1, ih, iw)


def attngan_words_loss(img_features, words_emb, labels, cap_lens, batch_size, gamma1, gamma2, gamma3):
    """img_features: batch x nef x 17 x 17; words_emb: batch x nef x seq_len. (w_loss0, w_loss1)."""
    similarities = []
    cap_lens = cap_lens.data.tolist()
    for i in range(batch_size):
        words_num = cap_lens[i]
        word = words_emb[i, :, :words_num].unsqueeze(0).contiguous()
        word = word.repeat(batch_size, 1, 1)
        context = img_features
        wei_context, attn = attngan_func_attention(word, context, gamma1)
        word = word.transpose(1, 2).contiguous()
        wei_context = wei_context.transpose(1, 2).contiguous()
        word = word.view(batch_size * words_num, -1)
        wei_context = wei_context.view(batch_size * words_num, -1)
        row_sim = attngan_cosine_similarity(word, wei_context)
        row_sim = row_sim.view(batch_size, words_num)
        row_sim = row_sim.mul(gamma2).exp()
        row_sim = row_sim.sum(dim=1, keepdim=True)
        row_sim = torch.log(row_sim)
        similarities.append(row_sim)
    similarities = torch.cat(similarities, 1)  # images x captions
    similarities = similarities * gamma3
    similarities1 = similarities.transpose(0, 1)
    loss0 = nn.CrossEntropyLoss()(similarities, labels)
    loss1 = nn.CrossEntropyLoss()(similarities1, labels)
    return loss0, loss1


def attngan_sent_loss(cnn_code, rnn_code, labels, gamma3, eps=1e-8):
    if cnn_code.dim() == 2:
        cnn_code = cnn_code.unsqueeze(0)
        rnn_code = rnn_code.unsqueeze(0)
    cnn_code_norm = torch.norm(cnn_code, 2, dim=2, keepdim=True)
    rnn_code_norm = torch.norm(rnn_code, 2, dim=2, keepdim=True)
    scores0 = torch.bmm(cnn_code, rnn_code.transpose(1, 2))
    norm0 = torch.bmm(cnn_code_norm, rnn_code_norm.transpose(1, 2))
    scores0 = scores0 / norm0.clamp(min=eps) * gamma3
    scores0 = scores0.squeeze()
    scores1 = scores0.transpose(0, 1)
    loss0 = nn.CrossEntropyLoss()(scores0, labels)
    loss1 = nn.CrossEntropyLoss()(scores1, labels)
    return loss0, loss1


def reference_parts(words, lengths, regions, sentence, image, gamma1=4.0, gamma2=5.0, gamma3=10.0) -> dict:
    """Our layouts into AttnGAN's: words (B, T, D) -> (B, D, T); regions (B, H*W, D) -> (B, D, H, W)."""
    b = words.shape[0]
    labels = torch.arange(b)
    img_features = regions.transpose(1, 2).reshape(b, -1, H, W)
    w_loss0, w_loss1 = attngan_words_loss(
        img_features, words.transpose(1, 2), labels, lengths, b, gamma1, gamma2, gamma3
    )
    s_loss0, s_loss1 = attngan_sent_loss(image, sentence, labels, gamma3)
    # loss0 ranks captions for each image (i2t), loss1 images for each caption (t2i)
    return {"words_t2i": w_loss1, "words_i2t": w_loss0, "sentence_t2i": s_loss1, "sentence_i2t": s_loss0}


# --- inputs ----------------------------------------------------------------------------------------


def batch(dtype=torch.float64, seed=0, b=B, lengths=LENGTHS) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "words": torch.randn(b, T, D, generator=g, dtype=dtype),
        "lengths": torch.tensor(lengths),
        "regions": torch.randn(b, H * W, D, generator=g, dtype=dtype),
        "sentence": torch.randn(b, D, generator=g, dtype=dtype),
        "image": torch.randn(b, D, generator=g, dtype=dtype),
    }


GRAD_INPUTS = ("words", "regions", "sentence", "image")


def with_grad(data: dict) -> dict:
    return {k: v.clone().requires_grad_() if k in GRAD_INPUTS else v for k, v in data.items()}


# --- tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("gammas", [(4.0, 5.0, 10.0), (1.5, 2.0, 3.0)])
def test_parts_equal_attngan_code(gammas):
    data = batch()
    got = damsm_parts(**data, gamma1=gammas[0], gamma2=gammas[1], gamma3=gammas[2])
    expected = reference_parts(**data, gamma1=gammas[0], gamma2=gammas[1], gamma3=gammas[2])
    assert tuple(got) == PARTS
    for name in PARTS:
        assert got[name].dtype == torch.float64 and got[name].dim() == 0
        assert float(expected[name]) > 0.1, name
        torch.testing.assert_close(got[name], expected[name], rtol=1e-12, atol=1e-12, msg=name)


def test_gradients_equal_attngan_code():
    data = with_grad(batch())
    loss = damsm_loss(**data)
    grads = torch.autograd.grad(loss, [data[k] for k in GRAD_INPUTS])
    reference = with_grad(batch())
    expected_loss = sum(reference_parts(**reference).values())
    expected = torch.autograd.grad(expected_loss, [reference[k] for k in GRAD_INPUTS])
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-12)
    for name, got, want in zip(GRAD_INPUTS, grads, expected, strict=True):
        assert want.abs().max() > 1e-3, name
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
    # AttnGAN slices the real words: the padding gets no gradient
    words_grad = grads[0]
    for i, n in enumerate(LENGTHS):
        assert torch.all(words_grad[i, n:] == 0)


def test_padding_content_changes_nothing():
    clean = with_grad(batch())
    for i, n in enumerate(LENGTHS):
        clean["words"].data[i, n:] = 0.0
    noisy = with_grad(batch())
    for i, n in enumerate(LENGTHS):
        noisy["words"].data[i, n:] = 1e3 * torch.randn(T - n, D, dtype=torch.float64)
    noisy["words"].data[1 if LENGTHS[1] < T else 0, -1] = float("nan")  # not even NaN
    noisy["words"].data[2, -1] = float("inf")
    losses, grads = [], []
    for data in (clean, noisy):
        loss = damsm_loss(**data)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, [data[k] for k in GRAD_INPUTS]))
    assert torch.equal(losses[0], losses[1]) and torch.isfinite(losses[0])
    for name, a, b in zip(GRAD_INPUTS, *grads, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


def test_aligned_batch_scores_lower_than_shuffled():
    data = batch(dtype=torch.float32, seed=3, b=6, lengths=[4] * 6)
    text = data["regions"][:, :4]  # each caption's words are its image's first regions
    aligned = dict(data, words=text, sentence=data["image"])
    shuffle = torch.tensor([1, 2, 3, 4, 5, 0])  # no image keeps its caption
    shuffled = dict(aligned, regions=data["regions"][shuffle], image=data["image"][shuffle])
    parts_aligned, parts_shuffled = damsm_parts(**aligned), damsm_parts(**shuffled)
    for name in PARTS:
        assert parts_aligned[name] < parts_shuffled[name], name
    assert damsm_loss(**aligned) < 0.5 * damsm_loss(**shuffled)


def test_parts_sum_to_the_loss():
    data = batch(dtype=torch.float32)
    parts = damsm_parts(**data)
    assert set(parts) == set(PARTS)
    torch.testing.assert_close(sum(parts.values()), damsm_loss(**data))
    torch.testing.assert_close(cross_rank_damsm_loss(**data), damsm_loss(**data))  # one process: the plain loss
    assert set(cross_rank_damsm_parts(**data)) == set(PARTS)


def test_word_region_scores_take_any_numbers_of_captions_and_images(monkeypatch):
    data = batch()
    full = word_region_scores(data["words"], data["lengths"], data["regions"])
    assert full.shape == (B, B)
    block = word_region_scores(data["words"][1:4], data["lengths"][1:4], data["regions"][:2])
    torch.testing.assert_close(block, full[1:4, :2], rtol=1e-13, atol=1e-13)
    # captions padded wider than needed: the same scores
    wide = torch.cat([data["words"], torch.randn(B, 3, D, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(word_region_scores(wide, data["lengths"], data["regions"]), full, rtol=1e-13, atol=1e-13)
    # chunks of one or two captions: the same scores
    monkeypatch.setattr(damsm_module, "_CHUNK_ELEMENTS", 2 * B * T * D)
    torch.testing.assert_close(
        word_region_scores(data["words"], data["lengths"], data["regions"]), full, rtol=1e-13, atol=1e-13
    )
    # and the diagonal is what the loss's word terms score
    labels = torch.arange(B)
    logits = 10.0 * full
    torch.testing.assert_close(nn.CrossEntropyLoss()(logits, labels), damsm_parts(**data)["words_t2i"])
    # no captions or no images: empty, and still differentiable
    regions = data["regions"].clone().requires_grad_()
    empty = word_region_scores(data["words"][:0], data["lengths"][:0], regions)
    assert empty.shape == (0, B) and empty.requires_grad


def test_half_precision_inputs_compute_in_float32():
    data = batch(dtype=torch.float32)
    low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in data.items()}
    got = damsm_loss(**low)
    assert got.dtype == torch.float32
    upcast = {k: v.float() if v.is_floating_point() else v for k, v in low.items()}
    torch.testing.assert_close(got, damsm_loss(**upcast), rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = damsm_loss(**data)
    assert under_autocast.dtype == torch.float32
    torch.testing.assert_close(under_autocast, damsm_loss(**data), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lengths, match", [([3, 0, 1, 5, 2], "length"), ([3, 8, 1, 5, 2], "length")])
def test_bad_lengths_are_refused(lengths, match):
    data = dict(batch(), lengths=torch.tensor(lengths))
    with pytest.raises(ValueError, match=match):
        damsm_loss(**data)


def test_bad_shapes_are_refused():
    data = batch()
    with pytest.raises(ValueError, match="one image per caption"):
        damsm_loss(**dict(data, regions=data["regions"][:3]))
    with pytest.raises(ValueError, match="sentence"):
        damsm_loss(**dict(data, sentence=data["sentence"][:, :3]))
    with pytest.raises(ValueError, match="lengths"):
        damsm_loss(**dict(data, lengths=data["lengths"].float()))
