"""train.compile's parts (vldist/training/compiling.py): which recipes and engines a mode is refused
for, and the count of recompilations after warm-up, on real torch.compile calls (backend `eager`:
dynamo's tracing and guards, no code generation, so that each test takes a second or two)."""

import logging

import pytest
import torch

from vldist.errors import ConfigError
from vldist.recipes.jobs import load_config
from vldist.recipes.vsrn import VSRNRecipe
from vldist.telemetry.flops import FlopCounter
from vldist.telemetry.progress import TrainingProgress
from vldist.training.compiling import StepCompiler, check_compile


class NotCompilable(VSRNRecipe):
    compile_step = False
    compile_step_refusal = "its negatives are drawn with Python's random module"


class Engine:  # what check_compile reads of an engine: its class, and a DeepSpeed engine's ZeRO stage
    pass


class DeepSpeedEngine:
    def __init__(self, stage):
        self.stage = stage


def _config(mode: str, *more: str):
    return load_config("vsrn", [f"train.compile={mode}", *more])


def test_every_mode_is_accepted_where_nothing_stands_in_its_way():
    for mode in ("none", "model", "step"):
        check_compile(_config(mode), VSRNRecipe, Engine())
    check_compile(_config("model"), VSRNRecipe, DeepSpeedEngine(2))


def test_a_recipe_that_refuses_step_is_named_with_the_alternative():
    NotCompilable.name = "not_compilable"
    with pytest.raises(ConfigError, match="recipe 'not_compilable'.*Python's random module.*train.compile=model"):
        check_compile(_config("step"), NotCompilable, Engine())
    check_compile(_config("model"), NotCompilable, Engine())


def test_step_under_deepspeed_and_any_mode_under_zero3_are_refused():
    with pytest.raises(ConfigError, match="train.compile=step.*DeepSpeed.*train.compile=model"):
        check_compile(_config("step"), VSRNRecipe, DeepSpeedEngine(2))
    with pytest.raises(ConfigError, match="train.compile=model under DeepSpeed ZeRO-3"):
        check_compile(_config("model"), VSRNRecipe, DeepSpeedEngine(3))


def test_an_unknown_mode_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="train.compile"):
        _config("everything")


class Scorer(torch.nn.Module):
    """A module of the test's own: torch 2.11's dynamo skips a bare torch.nn layer compiled in place
    (its frame is torch.nn's own code), where a model of layers compiles as vldist's do."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.layer(x)


def _compiler(dynamic: bool) -> StepCompiler:
    from vldist.data.vocab import Vocab

    config = _config("model", "train.compile_backend=eager", f"train.compile_dynamic={str(dynamic).lower()}")
    return StepCompiler(config, VSRNRecipe(config, Vocab(["a"]), feature_dim=4), Engine())


def test_a_first_step_that_ran_eager_is_not_the_warm_up():
    """On CUDA the first step runs under the FLOP counter, eager: the step after it is the warm-up
    (it compiles: on torch 2.11 it did not, before the counter forced that step eager), and no
    recompilation."""
    from vldist.training.compiling import compiled_graphs

    compiler = _compiler(True)
    layer = compiler.compile_model(Scorer())
    before = compiled_graphs()
    with compiler.watch(("a",)), FlopCounter(peak=1e12).measure():
        layer(torch.randn(8, 3)).sum().backward()
    assert compiled_graphs() == before
    for _ in range(2):
        with compiler.watch(("a",)):
            layer(torch.randn(8, 3)).sum().backward()
    assert compiled_graphs() > before
    assert compiler.recompilations == 0 and compiler._seen == {("a",)}


@pytest.mark.parametrize("dynamic", [True, False])
def test_graphs_compiled_after_warm_up_are_counted_as_recompilations(dynamic, caplog):
    """Static shapes (compile_dynamic=false): the ragged batch recompiles once, and that is counted;
    dynamic: it does not. A key's first step (another stream's) would be its own warm-up."""
    compiler = _compiler(dynamic)
    layer = compiler.compile_model(Scorer())
    with caplog.at_level(logging.INFO, logger="vldist.train"):
        for rows, key in [(8, "a"), (8, "a"), (5, "a"), (8, "a"), (5, "b")]:
            with compiler.watch((key,)):
                layer(torch.randn(rows, 3)).sum().backward()
    assert compiler.recompilations == (0 if dynamic else 1), caplog.text
    assert compiler._seen == {("a",)}  # b compiled nothing new: no warm-up of its own
    assert "warm-up of a compiled 1 graphs" in caplog.text
    assert ("recompiled after warm-up" in caplog.text) is not dynamic


def test_the_progress_records_carry_the_count_and_the_cuda_peak(tmp_path):
    progress = TrainingProgress(True, 2, 0, 1, tmp_path / "metrics.jsonl")
    common = {"epoch": 0, "samples": 8, "wait": 0.0, "losses": {"loss": 1.0, "grad_norm": 1.0}, "lr": 0.1}
    progress.step(step=1, recompilations=0, cuda_peak_memory_bytes=3 << 30, **common)
    progress.step(step=2, **common)  # an eager run on CPU: neither field
    progress.close()
    import json

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("recompilations") for r in records] == [0, None] and "recompilations" not in records[1]
    assert records[0]["cuda_peak_memory_bytes"] == 3 << 30 and "cuda_peak_memory_bytes" not in records[1]


def test_a_compile_mode_needs_inductor_and_reaches_torch_compile(monkeypatch):
    """train.compile_mode is inductor's: refused with another backend; with inductor it reaches
    torch.compile for the model (model) and for the losses (step). (What torch.compile then does
    with it is torch's: on a GPU, test_compile_equivalence.py's CUDA-graph test.)"""
    with pytest.raises(ConfigError, match="compile_mode=reduce-overhead.*inductor.*compile_backend=inductor"):
        check_compile(
            _config("model", "train.compile_backend=aot_eager", "train.compile_mode=reduce-overhead"),
            VSRNRecipe,
            Engine(),
        )
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: asked.append(options) or fn)
    from vldist.data.vocab import Vocab

    for mode in ("model", "step"):
        config = _config(mode, "train.compile_mode=reduce-overhead")
        StepCompiler(config, VSRNRecipe(config, Vocab(["a"]), feature_dim=4), Engine()).compile_model(Scorer())
    assert [options["mode"] for options in asked] == ["reduce-overhead"] * 2
    assert all(options["backend"] == "inductor" for options in asked)
