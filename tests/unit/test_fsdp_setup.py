"""engine.backend=fsdp's setup without a process group: the mesh shape of engine.fsdp_shard_size,
the modules sharded as units, the precision policy, and the settings refused by name."""

import pytest
import torch
from torch import nn

from vldist.distributed.fsdp_engine import mesh_shape, precision_policy, shard_units
from vldist.errors import ConfigError
from vldist.recipes.jobs import load_config


def test_shard_size_none_or_the_world_shards_over_every_rank():
    assert mesh_shape(4, None) == (4,) and mesh_shape(4, 4) == (4,)


def test_a_shard_size_that_divides_the_world_makes_replicas_of_sharded_groups():
    assert mesh_shape(4, 2) == (2, 2) and mesh_shape(8, 1) == (8, 1)


@pytest.mark.parametrize("shard_size", [3, 8])
def test_a_shard_size_that_does_not_divide_the_world_is_refused(shard_size):
    with pytest.raises(ConfigError, match=f"engine.fsdp_shard_size={shard_size} must divide the number of ranks"):
        mesh_shape(4, shard_size)


def test_shard_size_without_the_fsdp_backend_is_refused():
    with pytest.raises(ConfigError, match="engine.fsdp_shard_size=2 is a setting of engine.backend=fsdp"):
        load_config("vsrn", ["engine.fsdp_shard_size=2"])
    assert load_config("vsrn", ["engine.backend=fsdp", "engine.fsdp_shard_size=2"]).engine.fsdp_shard_size == 2


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(5, 4)
        self.decoder = nn.Linear(4, 5)
        self.decoder.weight = self.encoder.weight  # tied: one parameter in two children
        self.head = nn.Linear(5, 2)
        self.act = nn.ReLU()  # no parameters: not a unit


def test_units_are_children_with_parameters_and_tied_ones_stay_in_the_root():
    model = Tied()
    assert shard_units(model) == [model.head]


def test_a_model_may_name_its_blocks():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    model.fsdp_blocks = ["0.0", "0.1"]
    assert shard_units(model) == [model[0][0], model[0][1]]


def test_bf16_on_cuda_gathers_bf16_and_reduces_fp32_and_cpu_runs_fp32():
    cuda = precision_policy("bf16", on_cuda=True)
    assert (cuda.param_dtype, cuda.reduce_dtype, cuda.output_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    cpu = precision_policy("bf16", on_cuda=False)
    assert cpu.param_dtype is None and cpu.reduce_dtype is None


def test_fp16_is_refused_with_what_to_use():
    with pytest.raises(ConfigError, match="engine.mixed_precision=bf16"):
        precision_policy("fp16", on_cuda=True)
