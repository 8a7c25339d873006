"""Test helpers: a tiny shard set written with the real writer, with a signal a model can learn.

Each image has 3 regions; region r is a one-hot of an attribute word (plus noise), and every caption
names the three words. Region features and captions therefore agree, so retrieval is learnable.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import subprocess
import sys
import tarfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from vldist.data.vocab import Vocab
from vldist.shards.format.writer import ShardSetWriter

WORDS = ["red", "green", "blue", "yellow", "circle", "square", "star", "small", "large", "left", "right", "top"]
DIM = 32


def planted_sample(rng: np.random.Generator, regions: int = 3, dim: int = DIM) -> tuple[np.ndarray, list[str]]:
    """Region features (regions, dim) and 5 captions that agree: three words are drawn, region r
    is a noisy one-hot of word r mod 3, and every caption names the three words in some order."""
    attrs = rng.choice(len(WORDS), 3, replace=False)
    feats = np.zeros((regions, dim), np.float32)
    feats[np.arange(regions), attrs[np.arange(regions) % 3]] = 1.0
    feats += 0.1 * rng.standard_normal(feats.shape).astype(np.float32)
    captions = [" ".join(WORDS[a] for a in rng.permutation(attrs)) for _ in range(5)]
    return feats, captions


def write_planted_shards(
    out: Path, counts=None, shard_size: int = 50, seed: int = 0, dim: int = DIM, unreadable=(), key_prefix: str = ""
) -> Path:
    """`unreadable`: keys whose region features hold NaN, as a damaged feature file would;
    `key_prefix`: before every key (a second set whose samples are other images)."""
    counts = counts or {"train": 200, "val": 40, "test": 60}
    rng = np.random.default_rng(seed)
    train_captions = []
    with ShardSetWriter(out, shard_size=shard_size, source="planted-test") as writer:
        for split, n in counts.items():
            for i in range(n):
                feats, captions = planted_sample(rng, dim=dim)
                if split == "train":
                    train_captions += captions
                key = f"{key_prefix}{split}-{i:07d}"
                if key in unreadable:
                    feats[0, 0] = np.nan
                writer.write(
                    split,
                    {
                        "__key__": key,
                        "json": {
                            "id": key,
                            "split": split,
                            "captions": captions,
                            "region_boxes": [[0, 0, 10 * (r + 1), 10 * (r + 1)] for r in range(3)],
                        },
                        "regions.npy": feats.astype(np.float16),
                    },
                )
        writer.close({"features": {"extractor": "planted", "dim": dim}})
    Vocab.build(train_captions).save(out / "vocab.json")
    return out


@contextmanager
def tmpfs_mounted(path: Path, options: str = "size=1m"):
    """A tmpfs mounted at `path` (made here) with the mount options (`ro,size=1m`: a read-only
    filesystem, which stops root where chmod does not), unmounted by its path afterwards; the test
    is skipped where it cannot be mounted (not root, no mount)."""
    import os

    import pytest

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip() or 'mount failed'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


CUT_SHARD = "train-000001.tar"  # the shard cut_shard_copy cuts short


def sample_ends(path: Path) -> list[int]:
    """The byte where each sample of a tar shard ends (its last member's data padded to 512), in order."""
    ends: dict[str, int] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            ends[member.name.split(".", 1)[0]] = member.offset_data + -(-member.size // 512) * 512
    return list(ends.values())


def cut_shard_copy(planted: Path, out: Path, at) -> tuple[Path, int]:
    """A copy of a planted set with CUT_SHARD cut at byte `at(shard, sample_ends)` and without sample
    indexes (as a set written before them, or with them deleted); (the copy, whole samples the cut shard keeps)."""
    import shutil

    shutil.copytree(planted, out, ignore=shutil.ignore_patterns("*.idx.json"))
    shard = out / CUT_SHARD
    ends = sample_ends(shard)
    cut = at(shard, ends)
    shard.write_bytes(shard.read_bytes()[:cut])
    return out, sum(end <= cut for end in ends)


def write_scene_images(out: Path, counts=None, seed: int = 0, image_size: int = 64) -> Path:
    """A single-image set of rendered scenes (JPEG, five captions and the objects each, no
    features): the second stream of L2C and LAViTeR's images, in miniature."""
    import random

    from vldist.shards.synthetic.captions import make_captions
    from vldist.shards.synthetic.embedded_set import jpeg_bytes
    from vldist.shards.synthetic.scenes import generate_scene
    from vldist.shards.synthetic.synth import sample_metadata

    counts = counts or {"train": 48}
    rng = random.Random(seed)
    with ShardSetWriter(out, shard_size=32, source="scene-images-test") as writer:
        for split, n in counts.items():
            for i in range(n):
                scene = generate_scene(rng, image_size)
                key = f"{split}-{i:07d}"
                meta = sample_metadata(key, split, scene, make_captions(scene, rng), proposals=0)  # objects: AIMCoS
                writer.write(split, {"__key__": key, "jpg": jpeg_bytes(scene), "json": meta})
        writer.close({})
    return out


class OneStreamRecipe:
    """What the training streams need of a recipe, for tests of the streams alone: one stream of the
    train split, reading the JSON members, through the given sample and collate functions."""

    sample_keys, optional_keys = ("json",), ()

    def __init__(self, sample_fn, collate_fn):
        self.sample_fn, self.collate_fn = sample_fn, collate_fn

    @classmethod
    def train_streams(cls, config):
        return {"train": "train"}

    def stream_functions(self, name):
        return self.sample_fn, self.collate_fn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A free base port whose next port is free too (rank 1's metrics serve on base + 1)."""
    import socket

    for _ in range(50):
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def npy_bytes(array: np.ndarray) -> bytes:
    """An array as the bytes of a .npy file, as any tool writing shards would store it."""
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def write_tar(path: Path, members: dict[str, bytes]) -> None:
    """A shard written with plain tarfile: member name -> bytes, in the order given."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def read_shard_set(directory: Path) -> dict[str, list[tuple[str, dict[str, bytes]]]]:
    """Every sample of a shard set, per split in manifest order: (key, {extension: bytes})."""
    import json

    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    out = {}
    for split, entry in manifest["splits"].items():
        samples: dict[str, dict[str, bytes]] = {}
        for shard in entry["shards"]:
            with tarfile.open(Path(directory) / shard["file"]) as tar:
                for member in tar:
                    key, _, ext = member.name.partition(".")
                    samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
        out[split] = list(samples.items())
    return out


def npy_load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


# A 2-rank job of 2 epochs x 25 steps (200 samples, batch 8) with a record per step in
# metrics.jsonl: long enough to stop mid-epoch, short enough to run three times.
PREEMPT_JOB = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    "data.batch_size=8",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    "train.epochs=2",
    "eval.baseline=false",
    "train.log_every=1",
    "train.keep_last=10",
    "metrics.enabled=false",
    "engine.sync_batchnorm=true",
]
PREEMPT_STEPS, PREEMPT_EPOCH_STEPS = 50, 25
# A VSRN that trains an epoch of the planted shards in seconds, without the untrained baseline or a
# metrics port.
SMALL_VSRN = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    "data.batch_size=32",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    "eval.baseline=false",
    "metrics.enabled=false",
]
# A LAViTeR of a few thousand parameters a phase (test_laviter_train.py, the replica check of every recipe)
TINY_LAVITER_MODEL = [
    "model.embed_dim=32",
    "model.text_heads=2",
    "model.gf_dim=4",
    "model.df_dim=4",
    "model.itm_dim=32",
    "model.itm_heads=2",
    "model.itm_encoder_layers=1",
    "model.itm_decoder_layers=1",
    "model.itm_feedforward=64",
    "model.z_dim=16",
    "model.condition_dim=16",
    "model.residual_blocks=1",
]


def torchrun(ranks: int = 2) -> list[str]:
    """The command that starts `ranks` local ranks (gloo on CPU) of the script named after it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]


TORCHRUN = torchrun(2)
# On PYTHONPATH, it makes the embedded sets' builders build small sets (the real code and format)
SMALL_EMBEDDED_SETS = str(Path(__file__).parent / "integration" / "workers" / "small_embedded_set")


def run_on_two_ranks(script: Path, *args, timeout: float = 300) -> None:
    """`torchrun --nproc_per_node 2 SCRIPT ARGS...` (gloo); a failure shows the ranks' stderr."""
    proc = subprocess.run([*TORCHRUN, str(script), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def train_vsrn(capsys, *args) -> tuple[int, str]:
    """`python -m vldist.train vsrn ARGS...` run in this process: its exit code and stderr."""
    from vldist.train import main

    code = main(["vsrn", *map(str, args)])
    return code, capsys.readouterr().err


def profiled_vsrn(capsys, caplog, shards: Path, out: Path, steps: int, window: str, *args) -> str:
    """A small VSRN trained for `steps` steps with train.profile_steps=`window`, without
    validation; asserts it ended well and returns what it logged."""
    with caplog.at_level(logging.INFO, logger="vldist.train"):
        code, err = train_vsrn(
            capsys,
            f"data.shards={shards}",
            f"output.dir={out}",
            f"train.max_steps={steps}",
            f"train.profile_steps={window}",
            "train.validate_every=0",
            *SMALL_VSRN,
            *args,
        )
    assert code == 0, err[-2000:]
    return caplog.text


def wait_for_step(out: Path, step: int, proc=None, timeout: float = 240) -> None:
    """Until metrics.jsonl of run `out` records a training step >= `step` (fails if proc ends first)."""
    import json
    import time

    deadline = time.time() + timeout
    path = out / "metrics.jsonl"
    while True:
        if path.exists():
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
            if any(e.get("event") == "train" and e["step"] >= step for e in lines):
                return
        assert proc is None or proc.poll() is None, "the run ended before it reached the step"
        assert time.time() < deadline, f"no step {step} in {path} after {timeout} s"
        time.sleep(0.05)


def stop_event(out: Path) -> dict:
    """The 'stopped' record a stopped run leaves in metrics.jsonl."""
    import json

    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stops = [e for e in events if e["event"] == "stopped"]
    assert len(stops) == 1, stops
    return stops[0]


def weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(checkpoint / "model.safetensors")


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    """Bit for bit by default; `atol` for weights another torch version made (its kernels may round
    differently)."""
    assert a.keys() == b.keys()
    for name in a:
        gap = (a[name].double() - b[name].double()).abs().max().item() if a[name].numel() else 0.0
        assert gap <= atol, f"{name}: largest difference {gap:.3g} > {atol}"


def decoder_batch(
    vocab: int,
    features: int,
    batch: int = 3,
    regions: int = 4,
    seed: int = 0,
    start: int = 1,
    end: int = 2,
    pad: int = 0,
):
    """Region features, their mask (rows 1 and 2 padded) and captions (row 0 ended and padded, row
    2 ended on its last token) for the tests of the step-protocol decoders."""
    import torch

    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(batch, regions, features, generator=g)
    mask = torch.ones(batch, regions, dtype=torch.bool)
    mask[1, 2:] = False
    mask[2, 3:] = False
    tokens = torch.randint(3, vocab, (batch, 6), generator=g)
    tokens[:, 0] = start
    tokens[0, 3], tokens[0, 4:] = end, pad
    tokens[2, 5] = end
    return feats, mask, tokens


def stepwise_logits(decoder, features, mask, tokens):
    """The decoder's logits when it reads `tokens` one step at a time, and its last state."""
    import torch

    state, logits = decoder.init_state(features, mask), []
    for t in range(tokens.shape[1] - 1):
        step_logits, state = decoder.step(tokens[:, t], state)
        logits.append(step_logits)
    return torch.stack(logits, dim=1), state


def fit_captions(decoder, features, mask, tokens, lr: float, steps: int, stop_below: float = 0.0) -> float:
    """Teacher-forced Adam steps on a few captions (padding ignored); the last loss."""
    import torch

    optimizer = torch.optim.Adam(decoder.parameters(), lr=lr)
    for _ in range(steps):
        logits = decoder(features, mask, tokens)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], ignore_index=0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < stop_below:
            break
    return loss.item()


def bench_module(name: str):
    """bench/<name>.py as a module (bench/ is no package; its modules import ablation_runs by name)."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    key = name if name == "ablation_runs" else f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, bench / f"{name}.py")
        sys.modules[key] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]
