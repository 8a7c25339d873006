"""The replica check's parts (vldist/distributed/replicas.py): an exact hash of a tensor's bits,
what counts as replicated, and when a check is due. (On 2 gloo ranks: tests/integration/test_replicas.py.)"""

import pytest
import torch
from torch import nn

from vldist.distributed.replicas import ReplicaCheck, replicated_tensors, tensor_hash
from vldist.models.global_batchnorm import convert_global_batchnorm

WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64])
def test_every_flipped_bit_changes_the_hash_and_equal_tensors_share_it(dtype):
    torch.manual_seed(0)
    tensor = (torch.randn(70_001) * 100).to(dtype)  # more than one row of 2^16 words
    reference = tensor_hash(tensor)
    assert tensor_hash(tensor.clone()) == reference
    bits = 8 * tensor.element_size()
    for index in (0, 65_535, 65_536, 70_000):
        for bit in range(bits):
            words = tensor.clone().view(WORDS[tensor.element_size()])
            words[index] ^= (1 << bit) if bit < 63 else -(2**63)
            assert tensor_hash(words.view(dtype)) != reference, (index, bit)


def test_the_hash_sees_order_and_reads_a_view_as_its_values():
    matrix = torch.randn(64, 48)
    assert tensor_hash(matrix.flip(0)) != tensor_hash(matrix)
    assert tensor_hash(matrix.T) == tensor_hash(matrix.T.contiguous())  # a strided view: its values, in order
    assert tensor_hash(torch.empty(0)) == 0 and tensor_hash(torch.tensor([True, False])) != tensor_hash(
        torch.tensor([False, True])
    )


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(4, 3), nn.BatchNorm1d(3)
        self.register_buffer("table", torch.arange(5.0))


def test_batchnorm_statistics_count_only_where_they_are_global():
    """Without engine.sync_batchnorm each rank keeps its own running statistics (the engine does
    not broadcast buffers): not compared. With it they are the global batch's on every rank."""
    names = [name for name, _ in replicated_tensors(Net(), sync_batchnorm=False)]
    assert names == [
        "parameter linear.weight",
        "parameter linear.bias",
        "parameter norm.weight",
        "parameter norm.bias",
        "buffer table",
        "buffer norm.num_batches_tracked",
    ]
    synced = [name for name, _ in replicated_tensors(convert_global_batchnorm(Net()), sync_batchnorm=True)]
    assert "buffer norm.running_mean" in synced and "buffer norm.running_var" in synced


def test_partitioned_placeholders_are_not_compared():
    """ZeRO-3 leaves each parameter an empty placeholder outside its gather: nothing replicated."""
    net = Net()
    net.linear.weight.data = torch.empty(0)
    assert "parameter linear.weight" not in [name for name, _ in replicated_tensors(net, sync_batchnorm=False)]


def test_a_check_is_due_after_the_first_update_then_every_n_steps():
    check = ReplicaCheck(Net(), world_size=2, every=4, sync_batchnorm=False)
    assert check.due(13)  # the first update of this process (a resumed run's too)
    check.passed_at = 13
    assert [s for s in range(14, 25) if check.due(s)] == [16, 20, 24]
    assert not ReplicaCheck(Net(), world_size=1, every=4, sync_batchnorm=False).due(1)  # nothing to compare
    assert not ReplicaCheck(Net(), world_size=2, every=0, sync_batchnorm=False).due(1)  # off
