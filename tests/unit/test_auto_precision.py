"""engine.mixed_precision=auto (distributed/precision.py): bf16 where the device computes bf16
products natively (a CUDA card from Ampere on, a CPU with AMX or AVX512-BF16), fp32 elsewhere;
resolved by every engine, whatever this host has (the hardware checks are set here both ways)."""

import pytest
import torch

from vldist.distributed.accelerate_engine import AccelerateEngine
from vldist.distributed.deepspeed_config import deepspeed_config, deepspeed_precision
from vldist.distributed.precision import effective_precision
from vldist.recipes.jobs import load_config


def _cpu(monkeypatch, amx: bool, avx512_bf16: bool):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


def _cpu_with_amx(monkeypatch, present: bool):
    """An Intel CPU with AMX (it has AVX512-BF16 too), or a CPU with neither."""
    _cpu(monkeypatch, present, present)


@pytest.mark.parametrize("setting", ["no", "bf16", "fp16"])
def test_an_explicit_setting_is_kept_on_every_device(setting, monkeypatch):
    _cpu_with_amx(monkeypatch, True)
    assert effective_precision(setting, "cpu") == setting
    assert effective_precision(setting, torch.device("cuda", 0)) == setting


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected"),
    [(True, True, "bf16"), (False, True, "bf16"), (True, False, "bf16"), (False, False, "no")],
)
def test_auto_on_cpu_is_bf16_with_amx_or_avx512_bf16(amx, avx512_bf16, expected, monkeypatch):
    """Intel's AMX and AMD Zen 4's AVX512-BF16 both measured about 2x faster phrase steps in bf16."""
    _cpu(monkeypatch, amx, avx512_bf16)
    assert effective_precision("auto", "cpu") == expected


def test_a_torch_without_the_cpu_checks_means_fp32(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    assert effective_precision("auto", torch.device("cpu")) == "no"


def _card(monkeypatch, capability: tuple[int, int]):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    # what torch's default check answers on a V100 (it emulates bf16): not asked
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


@pytest.mark.parametrize(
    ("capability", "expected"), [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "no"), ((7, 0), "no")]
)
def test_auto_on_cuda_is_bf16_from_ampere_on_not_on_cards_that_emulate_it(capability, expected, monkeypatch):
    _card(monkeypatch, capability)
    _cpu_with_amx(monkeypatch, expected == "no")  # the host CPU does not decide for the card
    assert effective_precision("auto", "cuda:0") == expected


@pytest.mark.parametrize("device", ["xpu", "mps", "meta"])
def test_auto_on_another_device_is_fp32_whatever_the_host_cpu_has(device, monkeypatch):
    _cpu_with_amx(monkeypatch, True)
    assert effective_precision("auto", device) == "no"


def test_deepspeed_resolves_auto_on_cuda_and_trains_fp32_on_cpu(monkeypatch):
    job = load_config("vsrn", ["engine.backend=deepspeed", "engine.mixed_precision=auto"])
    _card(monkeypatch, (9, 0))
    _cpu_with_amx(monkeypatch, True)
    assert deepspeed_config(job, 1, on_cuda=True)["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert deepspeed_config(job, 1, on_cuda=False)["torch_autocast"]["enabled"] is False
    assert (deepspeed_precision(job, on_cuda=True), deepspeed_precision(job, on_cuda=False)) == ("bf16", "no")


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
        assert engine.precision == ("bf16" if amx else "no")  # what the log and metrics.json report
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
