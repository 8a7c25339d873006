"""Operators dispatched per training step by the caption decoders and the GRUs, per-token vs restructured.

    OMP_NUM_THREADS=1 python bench/decoder_launches.py --json docs/results/decoder_launches.json
    python bench/decoder_launches.py --from docs/results/decoder_launches.json   # the table

Every aten operator dispatched is at least one kernel launch on CUDA (views excepted: they are
counted apart), so the count of a forward+backward is what a launch-bound GPU step pays in host
time, and it can be measured without a GPU. "before" is the per-token reference, "after" what the
models run now:

- vsrn_decoder: VSRN's attention-GRU decoder; before = `step` over the tokens (the previous
  forward), after = `forward` (attention + GRU cell per token; embedding, dropout and the
  vocabulary projection once).
- adaptive_attention, show_tell: the captioner's decoders, unchanged (their forwards already run
  the attention resp. the whole LSTM outside a per-token loop); before = `step` over the tokens.
- region_gru, text_gru: `last_hidden_gru`'s packed path (lengths on the host: one device sync per
  call on CUDA) vs its padded path (what device lengths take now: no sync). On the CPU nn.GRU runs
  a per-step loop of operators; on CUDA it is one cuDNN call either way, so there only the sync
  differs.
- vsrn_model: VSRN's model (image encoder, text encoder, decoder) forward+backward with a stand-in
  loss; before = per-token decoder and packed GRUs.
- greedy, beam3: generation with the VSRN decoder (eval, max_len 20, an untrained model: no
  early stop); before = the stop flag read every step (sync_every=1, the CPU default) and, for
  the beam, every state entry reordered at every step; after = the flag read every 4 steps (the
  accelerator default) and only the entries the step changed reordered.
  `host reads` counts aten._local_scalar_dense (bool()/int() of a tensor) and copies from the
  device to the host: each a sync on CUDA.

Operator counts do not depend on the batch size (the table checks it at the demo size), so they
are counted at batch 2 (the text GRU: 9, one of each length); times are CPU seconds of one step at the full batch (median, min-max),
OMP_NUM_THREADS=1, on whatever machine ran it: noisy, the counts are the evidence.
`--device cuda` counts and times the same on a GPU (cuDNN RNNs and fused cells there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vldist.models import common, generation, image_encoder, text_encoder  # noqa: E402
from vldist.models.caption_decoder import AttentionCaptionDecoder  # noqa: E402
from vldist.models.captioners import AdaptiveAttentionDecoder, ShowTellDecoder  # noqa: E402
from vldist.models.generation import generate  # noqa: E402

TOKENS = 16  # caption tokens incl. <start>/<end>: 15 decoder steps
# VSRN: jobs/vsrn.yaml (demo) and jobs/vsrn_coco.yaml (paper); the captioner: jobs/captioner.yaml
# (demo) and the paper's sizes in its comments. Vocabularies: the synthetic scenes' is small, COCO's
# ~10k words (VSRN) and 9,487 (Neuraltalk2's at min count 5).
SIZES = {
    "demo": {
        "vsrn": dict(batch=128, regions=5, embed=256, word=300, hidden=256, vocab=200, region_dim=256),
        "captioner": dict(batch=320, regions=5, feature=256, hidden=256, embed=256, vocab=200),
    },
    "paper": {
        "vsrn": dict(batch=128, regions=36, embed=2048, word=300, hidden=512, vocab=10000, region_dim=2048),
        "captioner": dict(batch=100, regions=49, feature=2048, hidden=512, embed=512, vocab=9487),
    },
}
COUNT_BATCH = {"text_gru": TOKENS // 2 + 1}  # every length once
METADATA_OPS = {"aten.lift_fresh", "aten.detach", "aten._local_scalar_dense"}


class OperatorCount(TorchDispatchMode):
    """Counts every aten operator dispatched under it (the backward's too: CPU autograd runs on
    the calling thread)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func.overloadpacket)] += 1 if not func.is_view else 0
        self.ops["(views)"] += 1 if func.is_view else 0
        if func is torch.ops.aten._to_copy.default and args[0].device.type != "cpu":
            self.ops["(copies to the host)"] += kwargs.get("device") == torch.device("cpu")
        return func(*args, **kwargs)

    def summary(self) -> dict:
        views = self.ops["(views)"]
        launches = sum(n for op, n in self.ops.items() if not op.startswith("(") and op not in METADATA_OPS)
        reads = self.ops["aten._local_scalar_dense"] + self.ops["(copies to the host)"]
        return {"ops": launches, "views": views, "host_reads": reads}


def per_token_logits(decoder, features, mask, tokens):
    """The per-token reference: `step` over the tokens, as VSRN's decoder's forward used to."""
    state, logits = decoder.init_state(features, mask), []
    for t in range(tokens.shape[1] - 1):
        step_logits, state = decoder.step(tokens[:, t], state)
        logits.append(step_logits)
    return torch.stack(logits, dim=1)


def caption_loss(logits, tokens):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), ignore_index=0)


def decoder_case(kind: str, size: dict, batch: int):
    """(module, inputs, before step, after step) for one decoder; a step is forward+backward."""
    torch.manual_seed(0)
    if kind == "vsrn_decoder":
        s = size["vsrn"]
        decoder = AttentionCaptionDecoder(s["vocab"], s["embed"], s["word"], s["hidden"], 0.1)
        features = torch.randn(batch, s["regions"], s["embed"])
    else:
        s = size["captioner"]
        cls = AdaptiveAttentionDecoder if kind == "adaptive_attention" else ShowTellDecoder
        decoder = cls(s["vocab"], s["feature"], s["hidden"], s["embed"], 0.5)
        features = torch.randn(batch, s["regions"], s["feature"])
    mask = torch.ones(features.shape[:2], dtype=torch.bool)
    tokens = torch.randint(3, s["vocab"], (batch, TOKENS))
    decoder.train()

    def before():
        caption_loss(per_token_logits(decoder, features, mask, tokens), tokens).backward()

    def after():
        caption_loss(decoder(features, mask, tokens), tokens).backward()

    return before, after


def gru_case(kind: str, size: dict, batch: int):
    torch.manual_seed(0)
    s = size["vsrn"]
    if kind == "region_gru":
        gru = torch.nn.GRU(s["embed"], s["embed"], batch_first=True)
        x = torch.randn(batch, s["regions"], s["embed"], requires_grad=True)
        lengths = torch.full((batch,), s["regions"])  # precomputed regions: all real
    else:
        gru = torch.nn.GRU(s["word"], s["embed"], batch_first=True)
        x = torch.randn(batch, TOKENS, s["word"], requires_grad=True)
        # Lengths half to all of TOKENS, each present at every batch size counted: the packed
        # GRU's operators depend on which lengths occur.
        lengths = TOKENS - torch.arange(batch) % (TOKENS // 2 + 1)

    def before():
        common.last_hidden_packed(gru, x, lengths).sum().backward()

    def after():
        common.last_hidden_padded(gru, x, lengths).sum().backward()

    return before, after


def model_case(size: dict, batch: int):
    from vldist.recipes.vsrn import VSRNConfig, VSRNModel

    torch.manual_seed(0)
    s = size["vsrn"]
    cfg = VSRNConfig(embed_size=s["embed"], word_dim=s["word"], decoder_hidden=s["hidden"], gcn_kernel="torch")
    model = VSRNModel(cfg, s["region_dim"], s["vocab"]).train()
    regions = torch.randn(batch, s["regions"], s["region_dim"])
    mask = torch.ones(batch, s["regions"], dtype=torch.bool)
    tokens = torch.randint(3, s["vocab"], (batch, TOKENS))
    lengths = torch.full((batch,), TOKENS)

    def run(per_token: bool):
        gru = common.last_hidden_packed if per_token else common.last_hidden_padded
        image_encoder.last_hidden_gru = text_encoder.last_hidden_gru = gru
        forward = model.decoder.forward
        if per_token:
            model.decoder.forward = lambda f, m, t: per_token_logits(model.decoder, f, m, t)
        try:
            out = model(regions, mask, tokens, lengths)
            loss = (out["image"] * out["text"]).sum() + caption_loss(out["caption_logits"], tokens)
            loss.backward()
        finally:
            image_encoder.last_hidden_gru = text_encoder.last_hidden_gru = common.last_hidden_gru
            model.decoder.forward = forward

    return (lambda: run(True)), (lambda: run(False))


def generation_case(kind: str, size: dict, batch: int):
    torch.manual_seed(0)
    s = size["vsrn"]
    decoder = AttentionCaptionDecoder(s["vocab"], s["embed"], s["word"], s["hidden"], 0.1)
    features = torch.randn(batch, s["regions"], s["embed"])
    mask = torch.ones(batch, s["regions"], dtype=torch.bool)
    beam = 3 if kind == "beam3" else 1
    outputs = {}

    def run(before: bool):
        reorder = generation._reorder_beams
        if before:  # every state entry reordered at every step, as beam search used to
            generation._reorder_beams = lambda state, rows, same: generation._reorder(state, rows)
        try:
            outputs[before] = generate(decoder, features, mask, 1, 2, 20, beam, sync_every=1 if before else 4)
        finally:
            generation._reorder_beams = reorder

    return (lambda: run(True)), (lambda: run(False))


CASES = ["vsrn_decoder", "adaptive_attention", "show_tell", "region_gru", "text_gru", "vsrn_model", "greedy", "beam3"]


def build(kind: str, size: dict, batch: int):
    if kind in ("vsrn_decoder", "adaptive_attention", "show_tell"):
        return decoder_case(kind, size, batch)
    if kind in ("region_gru", "text_gru"):
        return gru_case(kind, size, batch)
    if kind == "vsrn_model":
        return model_case(size, batch)
    return generation_case(kind, size, batch)


def full_batch(kind: str, size: dict) -> int:
    return size["captioner" if kind in ("adaptive_attention", "show_tell") else "vsrn"]["batch"]


def count(fn) -> dict:
    with OperatorCount() as counter:
        fn()
    return counter.summary()


def timed(fn, repeats: int, device: torch.device) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def measure(kind: str, size_name: str, repeats: int, device: torch.device) -> dict:
    """One row. The cases are built on `device` (its default for every tensor made there); on
    CUDA the packed path then copies the device lengths to the host, as it used to."""
    size = SIZES[size_name]
    with device:
        before, after = build(kind, size, COUNT_BATCH.get(kind, 2))
    row = {"case": kind, "size": size_name, "count_batch": COUNT_BATCH.get(kind, 2)}
    row.update(before=count(before), after=count(after))
    batch = full_batch(kind, size)
    if size_name == "demo":  # the counts' independence of the batch, checked where it is cheap
        with device:
            full_before, full_after = build(kind, size, batch)
        row["same_counts_at_full_batch"] = count(full_before) == row["before"] and count(full_after) == row["after"]
    # Paper-size GRUs and the whole model take tens of seconds a step on one core: counted only.
    if repeats and not (size_name == "paper" and kind in ("region_gru", "text_gru", "vsrn_model")):
        with device:
            before, after = build(kind, size, batch)
        row["batch"] = batch
        row["before"]["seconds"] = timed(before, repeats, device)
        row["after"]["seconds"] = timed(after, repeats, device)
    return row


def seconds(entry: dict) -> str:
    times = entry.get("seconds")
    if not times:
        return "-"
    return f"{1e3 * statistics.median(times):.0f} ({1e3 * min(times):.0f}-{1e3 * max(times):.0f})"


def table(results: dict) -> str:
    lines = [
        f"torch {results['torch']}, {results.get('device', 'cpu')}, {results['machine']}, "
        f"OMP_NUM_THREADS={results['threads']}; "
        f"{TOKENS} tokens; times: ms per step, median (min-max) of {results['repeats']}",
        "",
        "| case | size | ops before | ops after | views before/after | host reads before/after | "
        "ms before | ms after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        b, a = row["before"], row["after"]
        checked = "" if row.get("same_counts_at_full_batch", True) else " (counts differ at full batch!)"
        lines.append(
            f"| {row['case']}{checked} | {row['size']} | {b['ops']} | {a['ops']} | {b['views']}/{a['views']} | "
            f"{b['host_reads']}/{a['host_reads']} | {seconds(b)} | {seconds(a)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--sizes", nargs="+", default=["demo", "paper"], choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per row (0: counts only)")
    parser.add_argument("--device", default="cpu", help="cpu (the evidence without a GPU) or cuda")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--from", dest="source", type=Path, help="print the table of earlier results")
    args = parser.parse_args()
    if args.source:
        print(table(json.loads(args.source.read_text())))
        return
    rows = []
    for size in args.sizes:
        for kind in args.cases:
            rows.append(measure(kind, size, args.repeats, torch.device(args.device)))
            print(f"{kind} {size}: {rows[-1]['before']['ops']} -> {rows[-1]['after']['ops']} ops", flush=True)
    results = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "machine": os.uname().nodename,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "tokens": TOKENS,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
