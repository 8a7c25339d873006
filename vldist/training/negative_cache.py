"""train.accumulate_negatives: accumulated micro-batches that keep the global batch's negatives
(GradCache, Gao et al. 2021; open_clip's `--accum-freq`).

One optimizer step over the N micro-batches of each of W ranks:

1. each micro-batch is embedded without gradient, after saving the random state (CPU and CUDA,
   as torch.utils.checkpoint does); the model's buffers are put back afterwards, so that
   BatchNorm's running statistics move once per micro-batch, as in plain accumulation;
2. the recipe's cross-batch loss runs once on the rank's embeddings of all N micro-batches,
   which it gathers across ranks itself: its value is the whole global batch's, and the gradient
   with respect to the rank's embeddings is d(global loss)/d(embeddings) (the gather's backward
   sums every rank's part);
3. each micro-batch runs again, with gradient, from its saved random state, and back-propagates
   sum(embeddings x cached gradient) plus its own terms (VSRN's caption loss), weighted by its
   share of the global batch. The re-run embeddings must equal the cached ones: a forward whose
   randomness the saved state does not cover is caught here (RandomStateMismatch).

Scaling: a rank's surrogates already carry its whole part of the global gradient, and both
engines average gradients over ranks, so each is back-propagated as one micro-batch's share
(x W, `engine.backward(surrogate, micro_batches=1)`). One process on the whole batch then takes
the same step (tests/integration/test_accumulate_negatives.py). Recipes opt in with
recipes/capabilities.py's CachesNegatives; docs/distributed.md says what is exact for each.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vldist.config import JobConfig
from vldist.distributed.collectives import global_sum
from vldist.distributed.heartbeat import heartbeat
from vldist.errors import ConfigError, RandomStateMismatch
from vldist.recipes.capabilities import CachesNegatives

# Re-run embeddings may differ from the cached ones by float noise only (the same kernels on the
# same inputs); a dropout mask drawn again differs by the embeddings' own size.
MISMATCH_TOLERANCE = 1e-3


def check_supported(config: JobConfig, recipe) -> None:
    """Raise ConfigError where train.accumulate_negatives cannot run with this job."""
    if not isinstance(recipe, CachesNegatives):
        reason = recipe.accumulate_negatives_refusal
    else:
        reason = recipe.negatives_refusal()
    if reason:
        raise ConfigError(
            f"train.accumulate_negatives=true: recipe '{recipe.name}' cannot keep the global batch's negatives "
            f"across micro-batches: {reason}. Set train.accumulate_negatives=false (each micro-batch then takes its "
            "negatives among its own rows), or fit the batch with more ranks instead of train.grad_accumulation"
        )
    if config.train.compile == "step":
        raise ConfigError(
            "train.compile=step compiles the recipe's losses whole, and train.accumulate_negatives splits them "
            "(a forward without gradient, the cross-batch loss, a forward with gradient per micro-batch). Use "
            "train.compile=model, which compiles the model's forward that both passes run"
        )


class NegativeCache:
    """Runs one update's micro-batches as the module docstring says, in place of the trainer's
    forward and backward per micro-batch."""

    def __init__(self, recipe: CachesNegatives, engine):
        self.recipe, self.engine = recipe, engine

    @classmethod
    def for_job(cls, config: JobConfig, recipe, engine) -> NegativeCache | None:
        if not config.train.accumulate_negatives:
            return None
        check_supported(config, recipe)
        return cls(recipe, engine)

    def accumulate(self, model: nn.Module, micro_batches: list[dict], update: str, finite) -> dict[str, float]:
        """Accumulate the gradients of `update` over `micro_batches` through `model` (the engine's
        wrapper); returns the global loss values. `finite(losses, update)`: their global sums,
        checked finite (the trainer's)."""
        recipe, engine = self.recipe, self.engine
        with heartbeat.phase_of(f"forward without gradient ({update})"):
            states, cached = self._embed(model, micro_batches, update)
        with heartbeat.phase_of(f"cross-batch loss ({update})"):
            logged, cached_grads = self._cross_batch(micro_batches, cached, update, finite)
        fractions = self._fractions(micro_batches)
        worst = torch.zeros((), device=engine.device)  # kept on the device: one host sync per step, not per micro-batch
        for i, batch in enumerate(micro_batches):
            with engine.micro_batch(last=i == len(micro_batches) - 1):
                _set_random_state(states[i], engine.device)
                with engine.autocast(), heartbeat.phase_of(f"forward ({update})"):
                    out = model(**recipe.forward_inputs(batch, update))
                    embeddings = recipe.cross_batch_embeddings(out)
                    own = recipe.micro_batch_losses(out, batch)
                worst = torch.maximum(worst, _difference(embeddings, cached[i], engine.device))
                # the cross-batch loss's gradient reaches the parameters through the embeddings
                surrogate = sum((embeddings[k].float() * g).sum() for k, g in cached_grads[i].items())
                if own:
                    for k, v in finite(own, update).items():
                        logged[k] = logged.get(k, 0.0) + v * fractions[i]
                    surrogate = surrogate + own["loss"] * fractions[i]
                with heartbeat.phase_of(f"backward ({update})"):
                    engine.backward(surrogate, 1)
        self._check_same_function(worst)
        return logged

    def _cross_batch(self, micro_batches, cached, update, finite) -> tuple[dict[str, float], list[dict]]:
        """The cross-batch loss's global values and its gradient with respect to each micro-batch's
        embeddings (none when this update has no cross-batch term: a pretraining phase)."""
        if not cached[0]:
            return {}, [{} for _ in cached]
        leaves = {k: torch.cat([c[k] for c in cached]).float().requires_grad_() for k in cached[0]}
        cross = self.recipe.cross_batch_losses(leaves, self.recipe.joined_batch(micro_batches))
        logged = finite(cross, update)
        grads = torch.autograd.grad(cross["loss"], list(leaves.values()), allow_unused=True)
        per_batch = [{} for _ in cached]
        for (k, leaf), grad in zip(leaves.items(), grads, strict=True):
            parts = (torch.zeros_like(leaf) if grad is None else grad).split([c[k].shape[0] for c in cached])
            for target, part in zip(per_batch, parts, strict=True):
                target[k] = part
        return logged, per_batch

    def _embed(self, model, micro_batches, update) -> tuple[list, list[dict[str, Tensor]]]:
        """Each micro-batch's random state and cross-batch embeddings, computed without gradient;
        the buffers (BatchNorm's running statistics) as they were before."""
        recipe, engine = self.recipe, self.engine
        buffers = [(b, b.detach().clone()) for b in engine.unwrap().buffers()]
        states, cached = [], []
        with torch.no_grad():
            for batch in micro_batches:
                states.append(_random_state(engine.device))
                with engine.autocast():
                    out = model(**recipe.forward_inputs(batch, update))
                cached.append({k: v.detach() for k, v in recipe.cross_batch_embeddings(out).items()})
                del out  # the caption logits and the like: only the embeddings are kept
            for buffer, saved in buffers:
                buffer.copy_(saved)
        return states, cached

    def _fractions(self, micro_batches: list[dict]) -> list[float]:
        """Each micro-batch's share of the global batch's per-micro-batch terms (one all-reduce)."""
        weights = [float(self.recipe.micro_batch_weight(b)) for b in micro_batches]
        totals = global_sum(torch.tensor(weights, dtype=torch.float64, device=self.engine.device)).tolist()
        whole = sum(totals)
        return [t / whole if whole else 0.0 for t in totals]

    def _check_same_function(self, worst: Tensor) -> None:
        """Every rank raises together (one all-reduce), none waits in a later collective."""
        mismatched = int(global_sum((worst > MISMATCH_TOLERANCE).float().reshape(1)))
        if mismatched:
            raise RandomStateMismatch(
                f"train.accumulate_negatives: a micro-batch's embeddings re-run with gradient differ from those "
                f"cached without gradient (on {mismatched} rank(s); here by {float(worst):.3g} of their size), so the "
                "cached gradients belong to another function. The forward draws randomness the saved torch CPU "
                "and CUDA generator states do not cover (Python's random, numpy, another generator) or runs "
                "nondeterministic kernels. Draw from torch's default generators, or set "
                "train.accumulate_negatives=false"
            )


def _random_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_random_state(state: tuple, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _difference(embeddings: dict[str, Tensor], cached: dict[str, Tensor], device: torch.device) -> Tensor:
    """The largest difference between re-run and cached embeddings, relative to their size (a
    0-d tensor on their device)."""
    worst = torch.zeros((), device=device)
    for k, again in embeddings.items():
        before = cached[k].float()
        if before.numel():
            diff = (again.detach().float() - before).abs().max()
            worst = torch.maximum(worst, diff / before.abs().max().clamp(min=1e-12))
    return worst
