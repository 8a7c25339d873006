"""How a batch crosses from a loader worker to the trainer: its small tensors inside the pickle.

torch sends each tensor of a worker's batch through shared memory: the worker copies it into a
new segment, and the trainer receives the segment's file descriptor from the worker's
resource-sharer thread, one connection per tensor, served only once that thread gets the busy
worker's GIL. For a tensor of a few kilobytes (masks, token ids, lengths, identities) that costs
far more than the bytes: with the VSRN demo's batches (2 workers) the trainer's process spent
18 us of CPU a sample receiving them, against 12 us for a plain WebDataset pipeline, whose batches
hold one tensor fewer; with the small ones inline, 14 against 14 (the machine noisy). So tensors
up to SMALL bytes travel as numpy arrays in the batch's pickle and are tensors again on arrival,
the same values, dtype and shape; the large ones (region features, images) keep to shared memory.
A collate function that builds a large tensor in a worker writes it into shared memory from the
start (`batch_tensor`), so that the handoff has nothing left to copy.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import get_worker_info

SMALL = 64 * 1024  # bytes: copying this through the pipe costs less than a shared segment

# dtypes numpy holds as they are (bfloat16 and the like stay tensors)
_NUMPY_DTYPES = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
}


class Inline:
    """A small tensor on its way from a worker, as a numpy array."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __reduce__(self):
        return Inline, (self.array,)


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised tensor for a batch's large rows. In a loader worker it lies in shared memory
    from the start, as torch's default_collate allocates its stacks: a tensor made in private
    memory is copied whole into a new segment on its way out (67 MB a step of the two-branch
    phrase stage); elsewhere (no workers) it is an ordinary tensor."""
    nbytes = math.prod(shape) * dtype.itemsize
    if get_worker_info() is None or nbytes <= SMALL:
        return torch.empty(shape, dtype=dtype)
    return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes), 0, shape)


def packed(batch: dict) -> dict:
    """The batch for its way out of a worker: its small top-level tensors as Inline."""
    for key, value in batch.items():
        if (
            isinstance(value, torch.Tensor)
            and value.nbytes <= SMALL
            and value.dtype in _NUMPY_DTYPES
            and value.device.type == "cpu"
            and not value.requires_grad
            and type(value) is torch.Tensor
        ):
            batch[key] = Inline(value.numpy())
    return batch


def unpacked(batch, pin: bool):
    """The batch as the worker made it (Inline values tensors again, pinned where the loader pins)."""
    if not isinstance(batch, dict):
        return batch
    for key, value in batch.items():
        if isinstance(value, Inline):
            tensor = torch.from_numpy(value.array)
            batch[key] = tensor.pin_memory() if pin else tensor
    return batch
