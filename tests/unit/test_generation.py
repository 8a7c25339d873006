"""Greedy decoding, beam search and sentence log-probabilities (vldist.models.generation)."""

import itertools
import math

import pytest
import torch
from torch import nn

from vldist.models.common import masked_mean
from vldist.models.generation import beam_search, generate, greedy_decode, sequence_logprob

PAD, START, END = 0, 1, 2
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class ToyDecoder(nn.Module):
    """Deterministic step decoder: logits = transition[previous word] + image term + time bias +
    a recurrent memory of the previous logits, so a step depends on the word and on the state."""

    def __init__(self, vocab: int = 5, feature_dim: int = 3, seed: int = 0, transition=None, recurrent: float = 0.7):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(vocab, vocab, generator=g) * 2 if transition is None else transition
        self.register_buffer("transition", table)
        self.register_buffer("image", torch.randn(feature_dim, vocab, generator=g) * (transition is None))
        self.register_buffer("time_bias", torch.randn(8, vocab, generator=g) * (transition is None))
        self.recurrent = recurrent if transition is None else 0.0
        self.steps = 0
        self.seen = []  # (training, grad enabled) at each step

    def init_state(self, features, mask):
        image = masked_mean(features, mask) @ self.image
        return {
            "image": image,
            "memory": torch.zeros_like(image),
            "t": torch.zeros(features.shape[0], dtype=torch.long, device=features.device),
        }

    def step(self, words, state):
        self.steps += 1
        self.seen.append((self.training, torch.is_grad_enabled()))
        logits = self.transition[words] + state["image"] + self.time_bias[state["t"]] + self.recurrent * state["memory"]
        return logits, {"image": state["image"], "memory": torch.tanh(logits), "t": state["t"] + 1}


class ScriptedDecoder(nn.Module):
    """Says the words written in features[:, 0] (one id per feature), one per step, confidently."""

    def __init__(self, vocab: int = 6):
        super().__init__()
        self.vocab = vocab
        self.steps = 0

    def init_state(self, features, mask):
        return {"script": features[:, 0].long(), "t": torch.zeros(features.shape[0], dtype=torch.long)}

    def step(self, words, state):
        self.steps += 1
        said = state["script"].gather(1, state["t"][:, None]).squeeze(1)
        return 5.0 * nn.functional.one_hot(said, self.vocab).float(), {**state, "t": state["t"] + 1}


def _images(batch=4, regions=3, dim=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, regions, dim, generator=g)
    mask = torch.ones(batch, regions, dtype=torch.bool)
    mask[1:, -1] = False
    return features, mask


def _caption_logprob(decoder, features, mask, caption):
    """Total log-probability of one image's decoded caption (ids after <start>, 0 after <end>)."""
    state, word, total = decoder.init_state(features, mask), torch.tensor([START]), 0.0
    for w in caption:
        if int(word) == END:
            break
        logits, state = decoder.step(word, state)
        total += float(logits.log_softmax(-1)[0, w])
        word = torch.tensor([w])
    return total


def _brute_force(decoder, features, mask, vocab, max_len):
    """The best caption over every sequence ending at <end> or at max_len, by exhaustive search."""
    best, best_score = None, -math.inf
    for length in range(1, max_len + 1):
        for words in itertools.product(range(vocab), repeat=length):
            if PAD in words or START in words:  # never generated: not words
                continue
            if END in words[:-1] or (length < max_len and words[-1] != END):
                continue
            score = _caption_logprob(decoder, features, mask, list(words))
            if score > best_score:
                best, best_score = list(words), score
    return best, best_score


@pytest.mark.parametrize("seed", range(4))
def test_a_wide_beam_finds_the_exact_best_caption(seed):
    vocab, max_len = 5, 3
    decoder = ToyDecoder(vocab, seed=seed)
    features, mask = _images(batch=3, seed=seed)
    found = beam_search(decoder, features, mask, START, END, max_len, beam_size=vocab**max_len)
    for i in range(3):
        best, best_score = _brute_force(decoder, features[i : i + 1], mask[i : i + 1], vocab, max_len)
        got = found[i].tolist()[: len(best)]
        assert got == best and all(w == PAD for w in found[i, len(best) :].tolist())
        assert _caption_logprob(decoder, features[i : i + 1], mask[i : i + 1], got) == pytest.approx(best_score)


def test_pad_and_start_are_never_generated():
    decoder = ToyDecoder(5, seed=0)
    decoder.transition[:, [PAD, START]] += 50.0  # an untrained model may well prefer them
    features, mask = _images(batch=4, seed=0)
    for beam in (1, 3):
        out = generate(decoder, features, mask, START, END, max_len=4, beam_size=beam)
        assert START not in out.tolist()[0] and all(
            PAD not in row[: row.index(END) if END in row else len(row)] for row in out.tolist()
        )


@pytest.mark.parametrize("seed", range(6))
def test_beam_of_one_is_greedy(seed):
    decoder = ToyDecoder(6, seed=seed)
    features, mask = _images(batch=5, seed=seed)
    greedy = greedy_decode(decoder, features, mask, START, END, max_len=7)
    assert torch.equal(beam_search(decoder, features, mask, START, END, max_len=7, beam_size=1), greedy)
    assert torch.equal(generate(decoder, features, mask, START, END, max_len=7, beam_size=1), greedy)


def test_beam_of_three_beats_greedy_when_the_greedy_first_word_leads_nowhere():
    # Words 3 ("a") and 4 ("b"). First word: a 0.5, b 0.4, <end> 0.1. After "a" nothing is likely
    # (a 0.36, b 0.34, <end> 0.30); after "b", <end> 0.9. Greedy says "a a a" (0.065); the best is
    # "b <end>" (0.36).
    probs = torch.full((5, 5), 1e-6)
    probs[START, [3, 4, END]] = torch.tensor([0.5, 0.4, 0.1])
    probs[3, [3, 4, END]] = torch.tensor([0.36, 0.34, 0.30])
    probs[4, [3, 4, END]] = torch.tensor([0.05, 0.05, 0.9])
    probs[END, PAD] = probs[PAD, PAD] = 1.0
    decoder = ToyDecoder(5, transition=probs.log())
    features, mask = _images(batch=2)
    greedy = greedy_decode(decoder, features, mask, START, END, max_len=3)
    beam = beam_search(decoder, features, mask, START, END, max_len=3, beam_size=3)
    assert greedy.tolist() == [[3, 3, 3]] * 2
    assert beam.tolist() == [[4, END]] * 2
    greedy_score = _caption_logprob(decoder, features[:1], mask[:1], greedy[0].tolist())
    beam_score = _caption_logprob(decoder, features[:1], mask[:1], beam[0].tolist())
    assert beam_score == pytest.approx(math.log(0.4 * 0.9), abs=1e-4) and beam_score > greedy_score + 1.0


@pytest.mark.parametrize("beam_size", [1, 3, 4])
def test_a_batch_decodes_as_each_image_alone(beam_size):
    decoder = ToyDecoder(7, seed=3)
    features, mask = _images(batch=6, seed=3)
    together = generate(decoder, features, mask, START, END, max_len=6, beam_size=beam_size)
    for i in range(6):
        alone = generate(decoder, features[i : i + 1], mask[i : i + 1], START, END, max_len=6, beam_size=beam_size)[0]
        assert together[i, : len(alone)].tolist() == alone.tolist()
        assert (together[i, len(alone) :] == PAD).all()


@pytest.mark.parametrize("beam_size", [1, 3])
def test_end_token_is_kept_then_padding_and_decoding_stops_once_all_ended(beam_size):
    scripts = torch.tensor([[END, 3, 3, 3, 3], [3, 4, END, 5, 5], [3, 3, 3, 3, 3]], dtype=torch.float)
    features, mask = scripts[:, None, :], torch.ones(3, 1, dtype=torch.bool)
    decoder = ScriptedDecoder()
    out = generate(decoder, features, mask, START, END, max_len=4, beam_size=beam_size)
    assert out.tolist() == [[END, 0, 0, 0], [3, 4, END, 0], [3, 3, 3, 3]]  # the last is cut at max_len
    decoder.steps = 0
    out = generate(decoder, features[:2], mask[:2], START, END, max_len=4, beam_size=beam_size)
    assert out.tolist() == [[END, 0, 0], [3, 4, END]] and decoder.steps == 3  # stopped early
    assert generate(decoder, features[:1], mask[:1], START, END, max_len=4, beam_size=beam_size).tolist() == [[END]]


def test_generate_runs_in_eval_mode_without_gradients_and_restores_the_mode():
    decoder = ToyDecoder(5).train()
    generate(decoder, *_images(), START, END, max_len=3, beam_size=2)
    assert decoder.training and decoder.seen and set(decoder.seen) == {(False, False)}
    decoder.eval()
    generate(decoder, *_images(), START, END, max_len=3, beam_size=1)
    assert not decoder.training
    with pytest.raises(ValueError, match="beam_size"):
        generate(decoder, *_images(), START, END, max_len=3, beam_size=0)


def _direct_logprob(logits, targets):
    totals = []
    for b in range(logits.shape[0]):
        total = 0.0
        for t in range(logits.shape[1]):
            target = int(targets[b, t])
            if target == PAD:
                continue
            row = [float(x) for x in logits[b, t]]
            total += math.log(math.exp(row[target]) / sum(math.exp(x) for x in row))
        totals.append(total)
    return torch.tensor(totals)


def test_sequence_logprob_matches_the_direct_formula_and_is_differentiable():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 6, requires_grad=True)
    targets = torch.tensor([[4, 5, END, PAD], [3, END, PAD, PAD], [5, 4, 3, END]])
    got = sequence_logprob(logits, targets)
    assert got.dtype == torch.float32 and got.shape == (3,)
    assert torch.allclose(got, _direct_logprob(logits.detach(), targets), atol=1e-5)
    got.sum().backward()
    expected = (nn.functional.one_hot(targets, 6) - logits.detach().softmax(-1)) * (targets != PAD)[..., None]
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def test_sequence_logprob_is_float32_under_bf16_autocast():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7).bfloat16()
    targets = torch.tensor([[3, 4, 5, 6, END], [6, END, PAD, PAD, PAD]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = sequence_logprob(logits, targets)
    assert got.dtype == torch.float32
    assert torch.allclose(got, _direct_logprob(logits.float(), targets), atol=1e-5)


@needs_cuda
def test_decoding_on_cuda_matches_cpu():
    decoder = ToyDecoder(7, seed=5)
    features, mask = _images(batch=6, seed=5)
    for beam_size in (1, 3):
        cpu = generate(decoder, features, mask, START, END, max_len=6, beam_size=beam_size)
        gpu = generate(decoder.cuda(), features.cuda(), mask.cuda(), START, END, max_len=6, beam_size=beam_size)
        assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
        decoder.cpu()


@needs_cuda
def test_sequence_logprob_on_cuda_under_bf16_autocast():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, device="cuda", requires_grad=True)
    targets = torch.tensor([[3, 4, 5, 6, END], [6, END, PAD, PAD, PAD]], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = sequence_logprob(logits @ torch.eye(7, device="cuda"), targets)  # the matmul runs in bf16
    assert got.dtype == torch.float32
    got.sum().backward()
    assert torch.isfinite(logits.grad).all()
