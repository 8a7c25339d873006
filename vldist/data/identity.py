"""Stable identities of training samples, so that no sample is ever its own negative.

Training streams draw shards with replacement (data/pipeline.py), so one image can land twice in a
global batch; a cross-batch loss that masks negatives by batch row only would then rank the copy,
with an identical score, as the hardest negative. Every sample therefore carries an identity: the
image id its JSON names (`image_id`, for sets with one sample per caption of a shared image), else
its `__key__`, which is unique within a shard set (shards/README.md). The pipeline attaches it to
each batch as `batch["identity"]` (int64, one per sample), the losses gather it with the
embeddings and never take a pair of equal identity as a negative.

Identities are 63-bit hashes (blake2b, the same in every process and Python run, unlike `hash`),
so they travel through integer collectives; two distinct images collide with probability about
n^2 / 2^64 for n images in a batch, which is never.
"""

from __future__ import annotations

import hashlib
import json


def identity_of(name: str) -> int:
    """The 63-bit identity of an image name (a key or an image id), stable across processes."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def sample_identity(raw: dict) -> int:
    """The identity of a raw tar sample: its JSON's `image_id` when it names one, else its key."""
    meta = raw.get("json")
    if isinstance(meta, str):
        meta = meta.encode("utf-8")
    if isinstance(meta, bytes) and b'"image_id"' in meta:
        image_id = json.loads(meta).get("image_id")  # parsed here only for the sets that name one
        if image_id is not None:
            return identity_of(f"image_id:{image_id}")
    return identity_of(str(raw["__key__"]))
