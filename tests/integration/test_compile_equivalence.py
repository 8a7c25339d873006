"""train.compile takes the step eager takes: every built-in recipe's first step (its job's last
stage compiled; the stages it starts from run eager under both), compiled and eager, the same
losses (rtol 1e-4, atol 1e-5) and every parameter's gradient within atol 1e-5 + 1e-4 x the tensor's
largest entry (fp32), on 1 process, and on 2 gloo ranks for the recipes with cross-rank negatives;
and compiled runs of VSRN steady at zero recompilations over captions of varied lengths and a
ragged last batch.

Backends: `inductor` (generated C++ kernels) for VSRN on 1 process; `aot_eager` (dynamo and
AOTAutograd: the same graphs, forward and backward, run by eager kernels, no code generation)
elsewhere, because inductor's code generation would take minutes per recipe on the suite's CPUs.
Compiled, captions are padded to data.max_caption_len and the decoders' loops traced that many
steps: the jobs on the planted shards (captions of 5 tokens) set it to 6, not the default 32, so
that compiled batches are still padded and VSRN's and the captioners' tracing takes a fraction of
the time.
"""

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DIM, SMALL_VSRN, TORCHRUN, WORDS, assert_same_weights, train_vsrn, weights

from vldist.shards.synthetic.synth import build_synth

WORKER = Path(__file__).parent / "workers" / "compiled_first_step.py"
RTOL, ATOL = 1e-4, 1e-5
EVERY_JOB = ["vsrn", "captioner", "cl_caption", "two_branch_embed", "two_branch_sim", "l2c", "laviter"]
# the recipes whose objectives take negatives from the global batch (the captioner and L2C have
# none: on 2 ranks their step differs from one process only by DDP's gradient mean)
CROSS_RANK_JOBS = ["vsrn", "cl_caption", "two_branch_embed", "two_branch_sim", "laviter"]


@pytest.fixture(scope="module")
def small_synth(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "shards"
    build_synth(out, n_train=32, n_val=8, n_test=8, feature_size=32, progress=False)
    return out


@pytest.fixture
def sets(planted_shards, small_synth, pair_shards, scene_images, scene_splits):
    return [planted_shards, small_synth, pair_shards, scene_images, scene_splits]


def first_steps(
    out: Path, backend: str, modes: dict[str, list[str]], sets: list[Path], ranks: int, extra: tuple[str, ...] = ()
) -> None:
    launcher = TORCHRUN if ranks == 2 else [sys.executable]
    spec = ";".join(f"{mode}={','.join(jobs)}" for mode, jobs in modes.items())
    command = [*launcher, str(WORKER), str(out), backend, spec, *map(str, sets), *extra]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def assert_same_first_steps(out: Path, mode: str, ranks: int, jobs: list[str]) -> None:
    """Every job's last stage, compiled under `mode`, took its eager step."""
    compiled = sorted(out.glob(f"*.{mode}.rank*.pt"))
    # one file per job (its last stage) and rank
    assert sorted(path.name.split(".")[0] for path in compiled) == sorted(jobs * ranks), compiled
    for path in compiled:
        b = torch.load(path, weights_only=True)
        a = torch.load(path.with_name(path.name.replace(f".{mode}.", ".eager.")), weights_only=True)
        assert a["update"] == b["update"] and a["grads"], path.name
        # Where one side has a zero gradient and the other none (LAViTeR's discriminator update
        # reaches E_T with zeros in one of them; its optimizer steps only the discriminators and
        # the trainer clears every gradient before the next update), the step is the same.
        for name in a["grads"].keys() ^ b["grads"].keys():
            only = a["grads"].get(name, b["grads"].get(name))
            assert not only.any(), f"{path.name}: {name} has a non-zero gradient on one side only"
        for name, value in a["losses"].items():
            torch.testing.assert_close(b["losses"][name], value, rtol=RTOL, atol=ATOL, msg=f"{path.name}: {name}")
        for name, grad in ((n, g) for n, g in a["grads"].items() if n in b["grads"]):
            # relative to the tensor's largest entry: a gradient that cancels to ~0 (a bias before
            # BatchNorm) keeps the rounding noise of the large terms that cancelled
            gap, scale = (b["grads"][name] - grad).abs().max().item(), grad.abs().max().item()
            assert gap <= ATOL + RTOL * scale, f"{path.name}: {name} differs by {gap:.3g} (largest entry {scale:.3g})"


def test_every_recipe_compiled_takes_the_eager_step_on_one_process(sets, tmp_path):
    first_steps(tmp_path, "aot_eager", {"model": EVERY_JOB}, sets, ranks=1)
    assert_same_first_steps(tmp_path, "model", 1, EVERY_JOB)


def test_every_recipe_with_cross_rank_negatives_compiled_takes_the_eager_step_on_two_ranks(sets, tmp_path):
    """Also train.compile=step for VSRN: forward and loss in one compiled function; under DDP the
    wrapped module's forward is compiled apart (dynamo's DDP graphs), the cross-rank all_gather
    breaks the graph."""
    first_steps(tmp_path, "aot_eager", {"model": CROSS_RANK_JOBS, "step": ["vsrn"]}, sets, ranks=2)
    assert_same_first_steps(tmp_path, "model", 2, CROSS_RANK_JOBS)
    assert_same_first_steps(tmp_path, "step", 2, ["vsrn"])


def test_vsrn_compiled_with_inductor_takes_the_eager_step(sets, tmp_path):
    first_steps(tmp_path, "inductor", {"model": ["vsrn"]}, sets, ranks=1)
    assert_same_first_steps(tmp_path, "model", 1, ["vsrn"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vsrn_compiled_into_cuda_graphs_takes_the_eager_step_on_cuda(sets, tmp_path):
    """Inductor's Triton kernels in CUDA graphs (train.compile_mode=reduce-overhead), the model and
    the whole step, in fp32 without TF32, against eager on the same GPU: the compiled step is taken
    three times on the same batch and the third, a graph's replay, is compared."""
    cuda = ("train.device=cuda", "train.compile_mode=reduce-overhead", "engine.tf32=false")
    first_steps(tmp_path, "inductor", {"model": ["vsrn"], "step": ["vsrn"]}, sets, ranks=1, extra=cuda)
    assert_same_first_steps(tmp_path, "model", 1, ["vsrn"])
    assert_same_first_steps(tmp_path, "step", 1, ["vsrn"])


# ---------------------------------------------------------------- recompilations and resuming


@pytest.fixture(scope="module")
def varied_captions(tmp_path_factory) -> Path:
    """20 training images (batches of 8, 8 and a ragged 4) whose captions have 2 to 7 words."""
    from vldist.data.vocab import Vocab
    from vldist.shards.format.writer import ShardSetWriter

    out = tmp_path_factory.mktemp("varied") / "shards"
    rng, captions = np.random.default_rng(0), []
    with ShardSetWriter(out, shard_size=50, source="varied-test") as writer:
        for split, n in {"train": 20, "val": 8, "test": 8}.items():
            for i in range(n):
                texts = [" ".join(rng.choice(WORDS, 2 + (i + j) % 6)) for j in range(5)]
                captions += texts
                key = f"{split}-{i:07d}"
                regions = rng.standard_normal((3, DIM)).astype(np.float16)
                writer.write(
                    split,
                    {"__key__": key, "json": {"id": key, "split": split, "captions": texts}, "regions.npy": regions},
                )
        writer.close({"features": {"extractor": "planted", "dim": DIM}})
    Vocab.build(captions).save(out / "vocab.json")
    return out


TINY_VSRN = [
    *SMALL_VSRN,
    "model.rrr_layers=1",
    "model.decoder_dropout=0",
    "data.batch_size=8",
    "data.shuffle_buffer=8",
    "data.max_caption_len=10",
    "data.workers=0",
    "train.validate_every=0",
    "train.compile_backend=aot_eager",
]
# On the planted shards (captions of 5 tokens): compiled batches padded by one step, not five (the
# decoder's loop is traced at the padded length)
PLANTED_TINY_VSRN = [*TINY_VSRN, "data.max_caption_len=6"]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_compiled_run_over_varied_captions_and_a_ragged_batch_recompiles_nothing_after_warm_up(
    varied_captions, tmp_path, capsys, caplog
):
    """Two epochs of 8 + 8 + 4 images, captions of 2-7 words: every step after the first reuses
    its graphs. (That the count sees a recompilation: tests/unit/test_compiling.py, where static
    shapes make a ragged batch recompile.)"""
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="vldist.train"):
        code, err = train_vsrn(
            capsys,
            f"data.shards={varied_captions}",
            f"output.dir={out}",
            "train.epochs=2",
            "data.resampled=false",  # exact epochs: the last batch takes the 4 images left
            "train.log_every=1",
            "train.compile=model",
            *TINY_VSRN,
        )
    assert code == 0, err[-3000:]
    assert "warm-up of ('main',)/('main',) compiled" in caplog.text and "recompiled" not in caplog.text
    counts = [r["recompilations"] for r in _records(out) if r["event"] == "train"]
    assert counts == [0] * 6


@pytest.fixture(scope="module")
def three_eager_steps(planted_shards, tmp_path_factory) -> Path:
    from vldist.train import main

    out = tmp_path_factory.mktemp("eager") / "run"
    args = [f"data.shards={planted_shards}", *PLANTED_TINY_VSRN, f"output.dir={out}", "train.max_steps=3"]
    assert main(["vsrn", *args]) == 0
    return out / "checkpoints" / "step-00000003"


@pytest.mark.parametrize("first,then", [("none", "model"), ("model", "none")])
def test_a_run_resumes_across_compiled_and_eager(first, then, planted_shards, three_eager_steps, tmp_path, capsys):
    """3 steps, stopped after 2 (checkpoint) and resumed in the other mode, end where 3 eager steps
    do: checkpoints hold the same keys either way. Compiled runs pad captions (other float sums),
    hence a tolerance rather than bit equality."""
    common = [f"data.shards={planted_shards}", *PLANTED_TINY_VSRN]
    out = tmp_path / "run"
    code, err = train_vsrn(capsys, *common, f"output.dir={out}", "train.max_steps=2", f"train.compile={first}")
    assert code == 0, err[-3000:]
    code, err = train_vsrn(
        capsys, *common, f"output.dir={out}", "train.max_steps=3", "train.resume=latest", f"train.compile={then}"
    )
    assert code == 0, err[-3000:]
    steps = [r["step"] for r in _records(out) if r["event"] == "train"]
    assert steps[-1] == 3
    resumed, eager = weights(out / "checkpoints" / "step-00000003"), weights(three_eager_steps)
    # Biases that change no output have a gradient of 0 up to rounding, which Adam scales to
    # lr-sized steps of either sign, so their values are noise (seen: 1.15e-5 and 3.3e-5 apart):
    # the attention score's bias shifts every score of a softmax alike, and each RRR layer's W_r
    # bias is removed by the BatchNorm after it; that BatchNorm's running mean, the mean of W_r's
    # output, carries the bias's noise with it (seen 7.9e-5 apart, now that the compiled RRR layers
    # trace whole). They are in both checkpoints; every other weight must match.
    noise = re.compile(r"decoder\.att_score\.bias|image\.rrr\.\d+\.(w_r\.bias|bn\.running_mean)")
    assert any(map(noise.fullmatch, resumed)) and resumed.keys() == eager.keys()
    kept = [k for k in eager if not noise.fullmatch(k)]
    assert_same_weights({k: resumed[k] for k in kept}, {k: eager[k] for k in kept}, atol=1e-5)


def test_deepspeed_refuses_step_and_names_model(planted_shards, tmp_path, capsys):
    code, err = train_vsrn(
        capsys,
        f"data.shards={planted_shards}",
        f"output.dir={tmp_path / 'run'}",
        "engine.backend=deepspeed",
        "train.compile=step",
        *SMALL_VSRN,
    )
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert "train.compile=step" in err and "train.compile=model" in err
