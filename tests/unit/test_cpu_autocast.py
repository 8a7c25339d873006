"""engine.mixed_precision on CPU under the Accelerate engine: bf16 is autocast (the CPU's bf16
matrix units where it has them; docs/performance.md, "bf16 on the CPU"), fp16 and "no" train in
fp32, as DeepSpeed and FSDP do on CPU."""

import pytest
import torch

from vldist.distributed.accelerate_engine import AccelerateEngine
from vldist.recipes.jobs import load_config

pytestmark = pytest.mark.usefixtures("no_accelerate_state")  # tests/conftest.py


@pytest.mark.parametrize(
    ("precision", "matmul_dtype"), [("bf16", torch.bfloat16), ("no", torch.float32), ("fp16", torch.float32)]
)
def test_the_cpu_engine_runs_matmuls_in_bf16_only_when_asked(precision, matmul_dtype, tmp_path):
    config = load_config("vsrn", [f"output.dir={tmp_path}", "train.device=cpu", f"engine.mixed_precision={precision}"])
    engine = AccelerateEngine(config)
    try:
        x = torch.randn(4, 8)
        with engine.autocast():
            assert (x @ x.T).dtype == matmul_dtype
        assert engine.precision == ("bf16" if matmul_dtype == torch.bfloat16 else "no")
        assert (x @ x.T).dtype == torch.float32  # outside the step's forward: fp32
    finally:
        engine.close()
