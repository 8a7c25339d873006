"""The CPU engine the equivalence workers and their one-process references use."""

from vldist.distributed.accelerate_engine import AccelerateEngine
from vldist.recipes.jobs import load_config


def cpu_engine(config=None) -> AccelerateEngine:
    """Accelerate (DDP under torchrun, else one process) on the CPU, whatever the machine has."""
    config = config or load_config("vsrn", [])
    return AccelerateEngine(config.model_copy(update={"train": config.train.model_copy(update={"device": "cpu"})}))
