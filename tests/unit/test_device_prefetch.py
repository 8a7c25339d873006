"""DevicePrefetch hands over every batch on the device, values intact, the skipped ones as they
came; on CUDA each copy runs on its side stream, never on the stream that computes."""

import json

import pytest
import torch

from vldist.data.device_prefetch import DevicePrefetch


def _batches(count: int, pinned: bool = False) -> list[dict]:
    out = []
    for i in range(count):
        regions = torch.arange(i, i + 4096, dtype=torch.float32).reshape(64, 64)
        out.append(
            {
                "regions": regions.pin_memory() if pinned else regions,
                "identity": torch.tensor([i, i + 1]),
                "stream": "train",
                "skipped": i % 2,
            }
        )
    return out


def test_on_the_cpu_every_batch_is_handed_over_as_it_came():
    batches = _batches(5)
    handed = list(DevicePrefetch(iter(batches), "cpu"))
    assert len(handed) == 5
    for got, sent in zip(handed, batches, strict=True):
        assert got.keys() == sent.keys()
        assert torch.equal(got["regions"], sent["regions"]) and torch.equal(got["identity"], sent["identity"])
        assert (got["stream"], got["skipped"]) == (sent["stream"], sent["skipped"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_copies_run_on_the_side_stream_and_the_values_arrive(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda", torch.cuda.current_device())
    batches = _batches(4, pinned=True)
    sums = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefetch = DevicePrefetch(iter(batches), device)
        handed = []
        for batch in prefetch:
            handed.append(batch)
            if isinstance(batch["regions"], torch.Tensor) and batch["regions"].is_cuda:
                sums.append((batch["regions"] * 2).sum())  # a step's work, on the compute stream
        torch.cuda.synchronize(device)
    for got, sent in zip(handed, batches, strict=True):
        assert got["regions"].is_cuda and got["identity"].is_cuda
        assert torch.equal(got["regions"].cpu(), sent["regions"]) and torch.equal(
            got["identity"].cpu(), sent["identity"]
        )
    assert [float(s) for s in sums] == [float(b["regions"].sum() * 2) for b in batches]
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    copies = {e.get("args", {}).get("stream") for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]}
    kernels = {e.get("args", {}).get("stream") for e in events if e.get("cat") == "kernel"}
    assert copies and kernels and None not in copies | kernels, "the profile recorded no copy or kernel, or no stream"
    assert not copies & kernels  # the copies ran beside the computation, not before it in its stream
    assert len(copies) == 1  # the one side stream
