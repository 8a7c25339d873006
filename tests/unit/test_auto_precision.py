"""engine.mixed_precision=auto (distributed/precision.py): bf16 where the device has bf16 matrix
units (a CUDA card with bf16, a CPU with AMX), fp32 elsewhere; resolved by every engine, whatever
this host has (the hardware checks are set here both ways)."""

import pytest
import torch
from accelerate.state import AcceleratorState

from vldist.distributed.accelerate_engine import AccelerateEngine
from vldist.distributed.deepspeed_config import deepspeed_config
from vldist.distributed.precision import effective_precision
from vldist.recipes.jobs import load_config


def _cpu_with_amx(monkeypatch, present: bool):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: present)


@pytest.mark.parametrize("setting", ["no", "bf16", "fp16"])
def test_an_explicit_setting_is_kept_on_every_device(setting, monkeypatch):
    _cpu_with_amx(monkeypatch, True)
    assert effective_precision(setting, "cpu") == setting
    assert effective_precision(setting, torch.device("cuda", 0)) == setting


@pytest.mark.parametrize(("amx", "expected"), [(True, "bf16"), (False, "no")])
def test_auto_on_cpu_is_bf16_only_with_amx(amx, expected, monkeypatch):
    _cpu_with_amx(monkeypatch, amx)
    assert effective_precision("auto", "cpu") == expected


def test_a_torch_without_the_amx_check_means_fp32(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert effective_precision("auto", torch.device("cpu")) == "no"


@pytest.mark.parametrize(("bf16_card", "expected"), [(True, "bf16"), (False, "no")])
def test_auto_on_cuda_follows_the_cards_bf16(bf16_card, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_card)
    _cpu_with_amx(monkeypatch, not bf16_card)  # the host CPU does not decide for the card
    assert effective_precision("auto", "cuda:0") == expected


def test_deepspeed_resolves_auto_on_cuda_and_trains_fp32_on_cpu(monkeypatch):
    job = load_config("vsrn", ["engine.backend=deepspeed", "engine.mixed_precision=auto"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    _cpu_with_amx(monkeypatch, True)
    assert deepspeed_config(job, 1, on_cuda=True)["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert deepspeed_config(job, 1, on_cuda=False)["torch_autocast"]["enabled"] is False


@pytest.fixture
def no_accelerate_state():
    """Each case starts from no Accelerate state and leaves none."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _matmul_dtype(engine) -> torch.dtype:
    x = torch.randn(4, 8)
    with engine.autocast():
        return (x @ x.T).dtype


@pytest.mark.parametrize(("amx", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_the_accelerate_engine_autocasts_auto_as_the_cpu_allows(amx, dtype, monkeypatch, tmp_path, no_accelerate_state):
    _cpu_with_amx(monkeypatch, amx)
    job = load_config("vsrn", [f"output.dir={tmp_path}", "train.device=cpu", "engine.mixed_precision=auto"])
    engine = AccelerateEngine(job)
    try:
        assert _matmul_dtype(engine) == dtype
    finally:
        engine.close()


def test_runs_one_after_another_in_a_process_each_get_their_precision(tmp_path, no_accelerate_state):
    """Accelerate refuses a second precision in a process whose state it keeps; a closed engine leaves none."""
    dtypes = []
    for precision in ("bf16", "no", "bf16"):
        job = load_config("vsrn", [f"output.dir={tmp_path}", "train.device=cpu", f"engine.mixed_precision={precision}"])
        engine = AccelerateEngine(job)
        try:
            dtypes.append(_matmul_dtype(engine))
        finally:
            engine.close()
    assert dtypes == [torch.bfloat16, torch.float32, torch.bfloat16]


def test_a_run_after_one_whose_engine_was_never_closed_gets_its_own_precision(tmp_path, no_accelerate_state):
    """A run that failed before closing its engine (or a test that left one) must not decide the next run's precision."""
    left = AccelerateEngine(
        load_config("vsrn", [f"output.dir={tmp_path}", "train.device=cpu", "engine.mixed_precision=no"])
    )
    assert _matmul_dtype(left) == torch.float32
    job = load_config("vsrn", [f"output.dir={tmp_path}", "train.device=cpu", "engine.mixed_precision=bf16"])
    engine = AccelerateEngine(job)
    try:
        assert _matmul_dtype(engine) == torch.bfloat16
    finally:
        engine.close()
