"""The restructured decoder loops against their per-token references (issue 42, part 2a).

VSRN's teacher forcing (only attention + GRU cell per token) against `step` over the tokens:
logits and every parameter gradient, fp32, with dropout off (eval) and on (train, same seed: on
the CPU its one time-major dropout draw takes the masks of the T per-step draws). The GRU's padded
last-state path against packing. The searches' delayed stop checks against checking every step,
and beam search's skipped reorders against reordering everything.
"""

import itertools

import pytest
import torch
from helpers import decoder_batch, stepwise_logits
from torch import nn

from vldist.models import generation
from vldist.models.caption_decoder import AttentionCaptionDecoder
from vldist.models.common import last_hidden_gru, last_hidden_packed, last_hidden_padded
from vldist.models.generation import beam_search, greedy_decode
from vldist.models.running_captions import running_captions

PAD, START, END = 0, 1, 2
VOCAB, FEATURES = 12, 6
# fp32: the batched vocabulary projection and the summed per-step gradients round differently.
TOL = dict(rtol=1e-5, atol=1e-6)


def _logits_and_grads(decoder, run, where=None):
    decoder.zero_grad()
    logits = run()
    # A loss that weighs every logit differently (those `where` selects), so every gradient entry
    # is checked.
    weights = torch.linspace(-1.0, 1.0, logits.numel()).view_as(logits)
    if where is not None:
        weights = weights * where[..., None]
    (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in decoder.named_parameters()}


def _ragged_batch():
    """decoder_batch's captions, and two more rows: one that ends at once (<start> <end>) and one
    that is only <start> (it never runs), so the running rows shrink from four to one."""
    features, mask, tokens = decoder_batch(VOCAB, FEATURES, batch=5, regions=4, seed=1)
    tokens[3, 1], tokens[3, 2:] = END, PAD
    tokens[4, 1:] = PAD
    tokens[1, 4:] = PAD  # ended without <end>: its padding predicts nothing either
    return features, mask, tokens


@pytest.mark.parametrize("path", ["running", "running, checkpointed steps", "unrolled"])
@pytest.mark.parametrize("train", [False, True])
def test_vsrn_teacher_forcing_equals_stepping_with_gradients(train, path):
    """The CPU paths run only the captions still predicting a word (written out, or under autograd
    when activation checkpointing recomputes each step), so their logits equal stepping's where
    the target is a word (what the losses read); the unrolled path (accelerators, compile) equals
    it everywhere."""
    torch.manual_seed(0)
    decoder = AttentionCaptionDecoder(VOCAB, FEATURES, word_dim=16, hidden=24, dropout=0.3).train(train)
    features, mask, tokens = _ragged_batch()
    decoder.checkpoint_steps = path == "running, checkpointed steps"
    words = tokens[:, 1:] != PAD if path != "unrolled" else torch.ones_like(tokens[:, 1:], dtype=torch.bool)
    run = {
        "running": lambda: decoder(features, mask, tokens),
        "running, checkpointed steps": lambda: decoder(features, mask, tokens),
        "unrolled": lambda: decoder._unrolled(decoder.init_state(features, mask), tokens),
    }[path]
    torch.manual_seed(5)
    ref_logits, ref_grads = _logits_and_grads(
        decoder, lambda: stepwise_logits(decoder, features, mask, tokens)[0], words
    )
    ref_next = torch.rand(4)
    torch.manual_seed(5)
    logits, grads = _logits_and_grads(decoder, run, words)
    assert torch.equal(torch.rand(4), ref_next)  # the generator is left where stepping leaves it
    torch.testing.assert_close(logits[words], ref_logits[words], **TOL)
    assert ref_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)
    if train:  # dropout was on: the seeded masks agree, not merely the expectation
        torch.manual_seed(6)
        assert not torch.allclose(run(), logits)


def test_running_captions_shrink_longest_first():
    _, _, tokens = _ragged_batch()  # steps per row: 3, 3, 5, 1, 0
    running = running_captions(tokens)
    assert running.order.tolist() == [2, 0, 1, 3, 4] and running.running == [4, 3, 3, 1, 1]
    assert running_captions(tokens[[2]]) is None  # one caption to the last step: nothing to save
    assert running_captions(tokens[[2, 0]]).order is None  # already longest first
    # steps that run no row: their logits are the zero state's, the one word's are stepping's
    short = running_captions(tokens[[4, 3]])
    assert short.order.tolist() == [1, 0] and short.running == [1, 0, 0, 0, 0]
    torch.manual_seed(0)
    decoder = AttentionCaptionDecoder(VOCAB, FEATURES, word_dim=16, hidden=24).eval()
    features, mask, _ = _ragged_batch()
    with torch.no_grad():
        logits = decoder(features[[4, 3]], mask[[4, 3]], tokens[[4, 3]])
        reference = stepwise_logits(decoder, features[[4, 3]], mask[[4, 3]], tokens[[4, 3]])[0]
    torch.testing.assert_close(logits[1, 0], reference[1, 0], **TOL)
    torch.testing.assert_close(logits[:, 1:], decoder.out(torch.zeros(2, 4, 24)))


def test_vsrn_teacher_forcing_of_a_single_token_is_empty():
    decoder = AttentionCaptionDecoder(VOCAB, FEATURES, word_dim=16, hidden=24)
    features, mask, tokens = decoder_batch(VOCAB, FEATURES)
    assert decoder(features, mask, tokens[:, :1]).shape == (3, 0, VOCAB)


def test_gru_last_state_padded_equals_packed_with_gradients():
    torch.manual_seed(0)
    gru = nn.GRU(5, 7, batch_first=True)
    x = torch.randn(4, 6, 5, requires_grad=True)
    lengths = torch.tensor([3, 6, 1, 4])
    x_pad = x.detach().clone()
    x_pad[0, 3:] = 100.0  # whatever sits in the padding must not matter
    x_pad.requires_grad_(True)
    packed, padded = last_hidden_packed(gru, x, lengths), last_hidden_padded(gru, x_pad, lengths)
    torch.testing.assert_close(padded, packed, **TOL)
    torch.testing.assert_close(last_hidden_gru(gru, x, lengths), packed, **TOL)  # host lengths: packed rows
    weights = torch.randn(4, 7)
    ref = torch.autograd.grad((packed * weights).sum(), [x, *gru.parameters()])
    got = torch.autograd.grad((padded * weights).sum(), [x_pad, *gru.parameters()])
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert (got[0][0, 3:] == 0).all()


def test_gru_last_state_of_unpadded_sequences_is_the_full_runs_last_state_with_gradients():
    """No padding at all (every length the full K: the paper's 36 real regions): the GRU runs
    unpacked, which skips packing's per-step gradient buffers, and ends where packing ends."""
    torch.manual_seed(0)
    gru = nn.GRU(5, 7, batch_first=True)
    x = torch.randn(4, 6, 5, requires_grad=True)
    full = torch.full((4,), 6)
    weights = torch.randn(4, 7)
    got = last_hidden_gru(gru, x, full)
    ref = last_hidden_packed(gru, x, full)
    torch.testing.assert_close(got, ref, **TOL)
    # the state after the sixth step, h_t = GRU cell(x_t, h_{t-1}) written out step by step
    cell = nn.GRUCell(5, 7)
    cell.load_state_dict({k.removesuffix("_l0"): v for k, v in gru.state_dict().items()})
    h = torch.zeros(4, 7)
    for t in range(6):
        h = cell(x[:, t], h)
    torch.testing.assert_close(got, h, **TOL)
    for a, b in zip(
        torch.autograd.grad((got * weights).sum(), [x, *gru.parameters()]),
        torch.autograd.grad((ref * weights).sum(), [x, *gru.parameters()]),
        strict=True,
    ):
        torch.testing.assert_close(a, b, **TOL)


def test_attention_context_is_the_softmax_weighted_sum_of_the_real_regions():
    torch.manual_seed(0)
    decoder = AttentionCaptionDecoder(VOCAB, FEATURES, word_dim=16, hidden=24)
    features, mask, _ = decoder_batch(VOCAB, FEATURES, batch=3, regions=4, seed=1)
    mask[1, 2:] = False
    h = torch.randn(3, 24)
    keys = decoder.att_features(features)
    context = decoder._attend(keys, features, ~mask, h)
    # additive attention written out per image: score_r = w . tanh(key_r + W h + b) + c over the
    # real regions, softmax, then the weighted sum of their features
    for b in range(3):
        real = mask[b].nonzero().squeeze(1)
        hidden = decoder.att_hidden.weight @ h[b] + decoder.att_hidden.bias
        scores = torch.stack(
            [decoder.att_score.weight[0] @ torch.tanh(keys[b, r] + hidden) + decoder.att_score.bias[0] for r in real]
        )
        weights = scores.exp() / scores.exp().sum()
        expected = (weights[:, None] * features[b, real]).sum(0)
        torch.testing.assert_close(context[b], expected, **TOL)


class EndingDecoder(nn.Module):
    """A random step decoder whose captions end early and at different lengths."""

    def __init__(self, seed: int, vocab: int = 7):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("transition", torch.randn(vocab, vocab, generator=g) * 2)
        self.transition[:, END] += 2.0
        self.register_buffer("image", torch.randn(3, vocab, generator=g))
        self.steps = 0

    def init_state(self, features, mask):
        memory = features.new_zeros(features.shape[0], self.transition.shape[0])
        return {"image": features.mean(1) @ self.image, "memory": memory}

    def step(self, words, state):
        self.steps += 1
        logits = self.transition[words] + state["image"] + 0.5 * state["memory"]
        return logits, {**state, "memory": torch.tanh(logits)}


def _search(decoder, features, mask, beam_size, every):
    """The captions and the decoder's step count of one search."""
    decoder.steps = 0
    if beam_size == 1:
        out = greedy_decode(decoder, features, mask, START, END, 9, sync_every=every)
    else:
        out = beam_search(decoder, features, mask, START, END, 9, beam_size, sync_every=every)
    return out, decoder.steps


@pytest.mark.parametrize("beam_size", [1, 3])
def test_searches_give_the_same_captions_whenever_the_stop_flag_is_read(beam_size):
    stopped_at = set()
    for seed in range(6):
        decoder = EndingDecoder(seed)
        features = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(seed))
        mask = torch.ones(5, 2, dtype=torch.bool)
        reference, reference_steps = _search(decoder, features, mask, beam_size, 1)
        stopped_at.add(reference_steps)
        for every in (2, 3, 4, 20):
            out, steps = _search(decoder, features, mask, beam_size, every)
            assert torch.equal(out, reference), (seed, every)
            assert reference_steps <= steps < reference_steps + every
    assert len(stopped_at - {9}) >= 2  # the searches stopped early, at different steps


def test_an_empty_batch_decodes_as_before():
    decoder = EndingDecoder(0)
    features, mask = torch.zeros(0, 2, 3), torch.zeros(0, 2, dtype=torch.bool)
    for every in (1, 4):
        assert greedy_decode(decoder, features, mask, START, END, 5, sync_every=every).shape == (0, 1)
    with pytest.raises(ValueError, match="sync_every"):
        greedy_decode(decoder, features, mask, START, END, 5, sync_every=0)


class TieDecoder(nn.Module):
    """After <start>, an open word and <end> tie exactly (log 1/2 each): the beam search stops
    there, its pick among the tied depending on topk's order. Any continuation of the open word
    loses another log 2, so searching on would change the pick."""

    def __init__(self, end, word, then_a, then_b, vocab=6):
        super().__init__()
        table = torch.zeros(vocab, vocab)
        table[START, [word, end]] = 100.0
        table[word, [then_a, then_b]] = 100.0
        table[then_a, end] = table[then_b, end] = table[end, end] = 100.0
        self.register_buffer("table", table)

    def init_state(self, features, mask):
        return {"features": features}

    def step(self, words, state):
        return self.table[words], state


def test_beam_search_keeps_the_pick_it_stopped_at_through_later_steps():
    features, mask = torch.zeros(1, 1, 2), torch.ones(1, 1, dtype=torch.bool)
    for end, word, then_a, then_b in itertools.permutations(range(2, 6)):
        decoder = TieDecoder(end, word, then_a, then_b)
        reference = beam_search(decoder, features, mask, START, end, 5, 2, sync_every=1)
        assert reference.shape == (1, 1)  # stopped after the first word
        for every in (2, 5):
            assert torch.equal(beam_search(decoder, features, mask, START, end, 5, 2, sync_every=every), reference)


class ContextDecoder(nn.Module):
    """Scores the next word by the word read and the word read at the last even step (its
    `context`, which it passes through unchanged at odd steps): beam search must carry each
    hypothesis's own context, though the step does not always hand back a new tensor."""

    def __init__(self, seed: int, vocab: int = 7):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("first", torch.randn(vocab, vocab, generator=g) * 2)
        self.register_buffer("second", torch.randn(vocab, vocab, generator=g) * 2)
        self.register_buffer("image", torch.randn(3, vocab, generator=g))

    def init_state(self, features, mask):
        rows = features.shape[0]
        return {
            "image": features.mean(1) @ self.image,
            "context": torch.full((rows,), START),
            "t": torch.zeros(rows, dtype=torch.long),
        }

    def step(self, words, state):
        logits = self.first[words] + self.second[state["context"]] + state["image"]
        even = int(state["t"][0]) % 2 == 0  # every row is at the same step
        return logits, {**state, "context": words if even else state["context"], "t": state["t"] + 1}


def test_beam_search_skips_reordering_only_what_is_the_same_across_an_images_beams(monkeypatch):
    features = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 2, dtype=torch.bool)
    found = [beam_search(ContextDecoder(seed), features, mask, START, END, 7, 3) for seed in range(6)]
    # The reference reorders every entry at every step, as beam search always did.
    monkeypatch.setattr(generation, "_reorder_beams", lambda state, rows, same: generation._reorder(state, rows))
    for seed in range(6):
        assert torch.equal(found[seed], beam_search(ContextDecoder(seed), features, mask, START, END, 7, 3)), seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_restructured_paths_match_their_references(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # cuDNN's RNNs in full fp32
    torch.manual_seed(0)
    decoder = AttentionCaptionDecoder(VOCAB, FEATURES, word_dim=16, hidden=24).cuda().eval()
    features, mask, tokens = (t.cuda() for t in decoder_batch(VOCAB, FEATURES))
    reference = stepwise_logits(decoder, features, mask, tokens)[0]
    torch.testing.assert_close(decoder(features, mask, tokens), reference, rtol=1e-4, atol=1e-5)
    gru = nn.GRU(5, 7, batch_first=True).cuda()
    x, lengths = torch.randn(4, 6, 5, device="cuda"), torch.tensor([3, 6, 1, 4], device="cuda")
    packed = last_hidden_packed(gru, x, lengths.cpu())
    torch.testing.assert_close(last_hidden_gru(gru, x, lengths), packed, rtol=1e-4, atol=1e-5)  # padded path
    for beam in (1, 3):  # the default reads the stop flag every 4 steps on CUDA
        every_step = generation.generate(decoder, features, mask, START, END, 9, beam, sync_every=1)
        assert torch.equal(generation.generate(decoder, features, mask, START, END, 9, beam), every_step)
