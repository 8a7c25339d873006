"""Batches from loader workers arrive as the workers made them, their small tensors carried in the
pickle (data/batch_handoff.py) and the large ones through shared memory: same types, dtypes,
shapes and values as torch's own hand-over of every tensor through shared memory."""

import torch

from vldist.data.batch_handoff import SMALL, Inline
from vldist.data.pipeline import EvalStream, StreamSpec, make_loader
from vldist.data.shardset import ShardSet


def _sample(raw, rng):
    return {"key": raw["__key__"], "draw": rng.random()}


def _collate(samples):
    n = len(samples)
    draws = torch.tensor([s["draw"] for s in samples], dtype=torch.float64)
    return {
        "keys": [s["key"] for s in samples],
        "draws": draws,
        "mask": draws > 0.5,
        "half": draws.to(torch.float16),
        "tokens": (draws * 1000).long().view(n, 1).expand(n, 3),  # not contiguous
        "large": draws.float().repeat_interleave(SMALL // 4 // n + 1),  # over SMALL: shared memory
        "brain": draws.to(torch.bfloat16),  # numpy has no bfloat16: stays a tensor
    }


def test_small_tensors_travel_inline_and_every_tensor_arrives_as_made(planted_shards, monkeypatch):
    from vldist.data import pipeline

    urls = ShardSet.open(planted_shards).urls("test")  # 2 shards, one a worker
    spec = StreamSpec(urls=urls, keep=("json",), sample_fn=_sample, collate_fn=_collate, batch_size=16)
    arrived = set()  # keys whose values came inline

    def unpacked(batch, pin):
        arrived.update(k for k, v in batch.items() if isinstance(v, Inline))
        return pipeline_unpacked(batch, pin)

    pipeline_unpacked = pipeline.unpacked
    monkeypatch.setattr(pipeline, "unpacked", unpacked)
    from_workers = list(make_loader(EvalStream(spec), 2))
    assert arrived == {"draws", "mask", "half", "tokens", "identity"}
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "packed", lambda batch: batch)  # every tensor through shared memory
        by_torch = list(make_loader(EvalStream(spec), 2))
    assert [b["keys"] for b in from_workers] == [b["keys"] for b in by_torch]
    for got, made in zip(from_workers, by_torch, strict=True):
        for key, value in made.items():
            if isinstance(value, torch.Tensor):
                assert type(got[key]) is torch.Tensor and got[key].dtype == value.dtype, key
                assert got[key].shape == value.shape and torch.equal(got[key], value), key


def _collate_into_buffer(samples):
    from vldist.data.batch_handoff import batch_tensor

    draws = torch.tensor([float(s["key"].rsplit("-", 1)[-1]) for s in samples])  # the same in every worker
    rows = batch_tensor((len(samples), SMALL // 4 + 1))  # over SMALL
    rows.copy_(draws[:, None].expand_as(rows))
    return {"keys": [s["key"] for s in samples], "rows": rows, "made_shared": torch.tensor([rows.is_shared()])}


def test_a_batch_tensor_is_made_in_shared_memory_in_a_worker_and_arrives_as_made(planted_shards):
    urls = ShardSet.open(planted_shards).urls("test")
    spec = StreamSpec(urls=urls, keep=("json",), sample_fn=_sample, collate_fn=_collate_into_buffer, batch_size=16)
    from_workers = list(make_loader(EvalStream(spec), 2))
    in_process = list(make_loader(EvalStream(spec), 0))
    assert [b["made_shared"].item() for b in from_workers] == [True] * len(from_workers)
    assert [b["made_shared"].item() for b in in_process] == [False] * len(in_process)

    def rows_by_key(batches):  # the workers split the shards between them: compare sample by sample
        return {key: row for b in batches for key, row in zip(b["keys"], b["rows"], strict=True)}

    got, made = rows_by_key(from_workers), rows_by_key(in_process)
    assert got.keys() == made.keys() and all(torch.equal(got[k], made[k]) for k in made)
