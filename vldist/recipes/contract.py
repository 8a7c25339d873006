"""The parts of the recipe contract the platform checks as it goes, so that a recipe breaking one
stops at the first evaluation, before training starts, with one line naming the recipe and the
field, rather than with a traceback after hours of training (docs/adding-a-method.md)."""

from __future__ import annotations

import numbers

from vldist.errors import RecipeContractError

# What the platform reads of every evaluation: printed above the results table, kept in metrics.json
COUNTS = {
    "n_images": "the number of images (or pairs, with 'unit') evaluated",
    "n_captions": "the number of captions evaluated",
}
GUIDE = "docs/adding-a-method.md, 'What evaluate returns'"


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_evaluation(recipe, metrics, selecting: bool = True) -> None:
    """Raise RecipeContractError unless `metrics` is what `Recipe.evaluate` must return (Evaluation)
    and the recipe's headline (and, `selecting`: on a validation result, its selection score) can be
    read from it."""
    name = recipe.name
    if not isinstance(metrics, dict):
        raise RecipeContractError(
            f"recipe '{name}': evaluate() returned a {type(metrics).__name__}, not a dict of "
            f"metrics with {' and '.join(map(repr, COUNTS))} ({GUIDE})"
        )
    for field, meaning in COUNTS.items():
        if not isinstance(metrics.get(field), int) or isinstance(metrics[field], bool) or metrics[field] < 0:
            found = "no" if field not in metrics else f"{metrics[field]!r} as"
            raise RecipeContractError(
                f"recipe '{name}': evaluate() returned {found} '{field}' ({meaning}, an int); "
                f"add it to the dict it returns ({GUIDE})"
            )
    line = recipe.headline(metrics)
    wrong = [key for key, value in line.items() if not _number(value)] if isinstance(line, dict) else None
    if wrong is None or wrong:
        what = f"'{wrong[0]}' is not a number" if wrong else f"it returned a {type(line).__name__}"
        raise RecipeContractError(
            f"recipe '{name}': headline() must return a flat dict of numbers (the progress "
            f"line prints them), but {what} ({GUIDE})"
        )
    score = recipe.selection_score(metrics) if selecting else 0.0
    if not _number(score):
        raise RecipeContractError(
            f"recipe '{name}': selection_score() returned {score!r}, not a number (it picks the "
            f"best epoch; higher is better) ({GUIDE})"
        )
