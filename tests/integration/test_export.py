"""`python -m vldist.export RUN [--checkpoint best|latest|step-N] --out DIR`: the export holds the
checkpoint's whole weights, config and vocabulary; `vldist.evaluate` reads it and gets the metrics
of the checkpoint itself; the README's own loading code runs on it; bad choices are refused by name."""

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from vldist.checkpoint.format import step_checkpoints, verify
from vldist.evaluate import evaluate_checkpoint
from vldist.export import main as export_main

README = Path(__file__).resolve().parents[2] / "README.md"


def _export(capsys, *args) -> tuple[int, str]:
    code = export_main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_an_export_holds_the_checkpoint_and_evaluates_like_it(trained_vsrn, tmp_path, capsys):
    out = tmp_path / "export"
    code, printed = _export(capsys, trained_vsrn, "--checkpoint", "best", "--out", out)
    best = trained_vsrn / "checkpoints" / "best"
    assert code == 0 and f"exported {best}" in printed and "model.safetensors" in printed, printed
    verify(out)  # itself a complete checkpoint: files.json, COMPLETE
    assert not (out / "state.pt").exists() and not (out / "optimizer.pt").exists()  # the model alone
    exported, saved = load_file(out / "model.safetensors"), load_file(best / "model.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    assert (out / "vocab.json").read_text() == (best / "vocab.json").read_text()

    _, from_export = evaluate_checkpoint(out, device="cpu")
    _, from_checkpoint = evaluate_checkpoint(best, device="cpu")
    assert from_export["full"] == from_checkpoint["full"] and from_export["n_captions"] == from_checkpoint["n_captions"]
    assert from_export["full"]["rsum"] > 0

    # The README's example, as a user would paste it, pointed at this export.
    block = re.search(r"<!-- export-example -->\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(block.replace("vsrn-export", str(out)), scope)  # noqa: S102 - the README's own code
    model = scope["model"]
    assert all(torch.equal(v, exported[k]) for k, v in model.state_dict().items() if k in exported)
    assert {k for k, _ in model.named_parameters()} <= exported.keys()


def test_a_step_checkpoint_and_latest_export_and_bad_choices_are_refused(trained_vsrn, tmp_path, capsys):
    steps = step_checkpoints(trained_vsrn / "checkpoints")
    newest = steps[-1]
    code, printed = _export(capsys, trained_vsrn, "--checkpoint", "latest", "--out", tmp_path / "latest")
    assert code == 0 and f"exported {newest}" in printed
    step = int(newest.name.split("-")[1])
    code, printed = _export(
        capsys, trained_vsrn, "--checkpoint", f"step-{step}", "--out", tmp_path / "latest", "--force"
    )
    assert code == 0, printed  # over an earlier export: replaced with --force

    code, printed = _export(capsys, trained_vsrn, "--checkpoint", "step-999", "--out", tmp_path / "x")
    assert code == 2 and "step-999" in printed and f"available: best, {newest.name}" in printed
    code, printed = _export(capsys, trained_vsrn, "--checkpoint", "newest", "--out", tmp_path / "x")
    assert code == 2 and "not one of best, latest or step-N" in printed
    occupied = tmp_path / "mine"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("keep me")
    code, printed = _export(capsys, trained_vsrn, "--out", occupied)
    assert code == 2 and "is not an earlier export" in printed and (occupied / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "x").exists()
