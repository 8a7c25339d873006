"""The files a reader opens to follow a job from argv to its first loss, traced from a real run.

    python bench/reader_path.py [JOB [key=value ...]]      # default: vsrn, one step, in this process

A file is on the path when it holds a function on the call stack at one of the moments that make
the loss: the job loaded (its file read and checked, its recipe found by name), the engine made and wrapped around the model, the shard sets opened, the
recipe made, the model built, the optimizers built, a batch made, the model's forward and the loss
computed (with every file that the last four call into). The evaluation that checks the recipe's
contract before training is not on it. Prints the files in the order first met and their count
(docs/architecture.md lists them).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import vldist

PACKAGE = str(Path(vldist.__file__).parent) + os.sep
# the moments: the stack that reaches them, and for DEEP ones also every call they make
STACK = {
    "load_config",
    "validate",
    "get_recipe",
    "make_engine",
    "open_job_shards",
    "build_optimizers",
    "setup",
    "__init__",
}
DEEP = {"build_model", "train_sample", "collate_train", "forward", "losses"}
OFF_PATH = ("training/split_evaluation.py", "training/evaluations.py")


def main(argv: list[str]) -> int:
    job = argv or ["vsrn"]
    out = tempfile.mkdtemp(prefix="reader-path-")
    job += [f"output.dir={out}", "train.max_steps=1", "data.workers=0", "metrics.enabled=false"]
    path: dict[str, None] = {}

    def watch(frame, event, arg):
        if event != "call" or not _ours(frame.f_code):
            return
        stack = []
        f, deep = frame, frame.f_code.co_name in DEEP
        while f is not None:
            if _ours(f.f_code):
                stack.append(f.f_code.co_filename[len(PACKAGE) :])
                deep = deep or (f is not frame and f.f_code.co_name in DEEP)
            f = f.f_back
        if any(s in OFF_PATH for s in stack):
            return
        if deep or _a_moment(frame):
            path.update(dict.fromkeys(reversed(stack)))

    import vldist.recipes.base as base

    training_losses = base.Recipe.training_losses

    def first_loss(self, model, batch, update="main"):
        training_losses(self, model, batch, update)
        sys.setprofile(None)
        print("\n".join(path))
        print(f"{len(path)} files from argv to the loss of `vldist.train {' '.join(argv or ['vsrn'])}`")
        sys.stdout.flush()
        os._exit(0)  # the loss is reached: the rest of the run is not on the path

    base.Recipe.training_losses = first_loss
    sys.setprofile(watch)
    from vldist.train import main as train

    return train(job)


def _ours(code) -> bool:
    # functions only (CO_OPTIMIZED): a class body or a module run at import is not a call a reader follows
    return code.co_filename.startswith(PACKAGE) and code.co_flags & 1 and not code.co_name.startswith("<")


def _a_moment(frame) -> bool:
    name = frame.f_code.co_name
    if name == "__init__":  # the recipe made, not every object's constructor
        return frame.f_code.co_filename.startswith(PACKAGE + "recipes" + os.sep)
    if name == "setup":
        return frame.f_code.co_filename.startswith(PACKAGE + "distributed" + os.sep)
    return name in STACK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
