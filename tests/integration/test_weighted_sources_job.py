"""`data.sources` in a whole job on 2 torchrun ranks: the exact epochs take each source's share,
counted three ways (the sample log's identities, metrics.jsonl's samples_by_source, and the mix's
own arithmetic), and the run resumed after its first epoch keeps counting where it stopped."""

import json
import subprocess
from collections import Counter

from helpers import SMALL_VSRN, TORCHRUN

from vldist.data.identity import identity_of
from vldist.data.mixture import Mixture
from vldist.data.shardset import ShardSet


def _keys(directory) -> list[str]:
    return [k for index in ShardSet.open(directory).sample_indexes("train") for k in index.keys]


def test_two_ranks_take_each_sources_share_of_every_exact_epoch(planted_shards, other_planted_shards, tmp_path):
    out = tmp_path / "run"
    sources = f"[{{shards: {planted_shards}, weight: 2, name: main}}, {{shards: {other_planted_shards}, name: other}}]"
    job = [
        *TORCHRUN,
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={planted_shards}",
        f"data.sources={sources}",
        "data.resampled=false",
        f"output.dir={out}",
        "train.sample_log=true",
        "train.log_every=1",
        *SMALL_VSRN,
    ]
    for epochs in (1, 2):  # the second run resumes after the first epoch
        done = subprocess.run(
            [*job, f"train.epochs={epochs}", "train.resume=auto"], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]

    epoch_samples = 320  # 200 + 120 train samples: the sets' sizes together
    share = Mixture([2.0, 1.0]).taken(epoch_samples)  # [213, 107]
    which = {identity_of(k): "main" for k in _keys(planted_shards)} | {
        identity_of(k): "other" for k in _keys(other_planted_shards)
    }
    lines = [
        json.loads(x) for rank in (0, 1) for x in (out / "samples" / f"rank-{rank}.jsonl").read_text().splitlines()
    ]
    for epoch in (0, 1):
        trained = Counter(which[i] for line in lines if line["epoch"] == epoch for i in line["identity"])
        assert [trained["main"], trained["other"]] == list(share)
        distinct = {i for line in lines if line["epoch"] == epoch for i in line["identity"]}
        # main's 213 exceed its 200 samples: all of them, 13 twice; other's 107 of 120, once each
        assert len(distinct) == min(200, share[0]) + min(120, share[1])
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r.get("event") == "train"][-1]
    assert last["samples_by_source"] == {"main": 2 * share[0], "other": 2 * share[1]}
    import torch

    final = sorted((out / "checkpoints").glob("step-*"))[-1]
    run = torch.load(final / "state.pt", weights_only=True)["run"]  # what a resume starts from
    assert run["samples_by_source"] == last["samples_by_source"]
    assert run["data_position"]["epoch"] == 2 and run["data_position"]["step"] == 0 and run["data_position"]["indexed"]
