"""The recipe registry: each paper method by name, and the recipes other packages add (plugins).

Built-in recipes are named by module and class and imported when first asked for, so that a
recipe module may itself load a job through the registry (CL reads its captioner's job) without
an import circle. Another installed package adds its own through the entry-point group
`vldist.recipes` (`name = "package.module:RecipeClass"`): `python -m vldist.train my_job.yaml`
then trains it, and `--help` lists it (docs/adding-a-method.md).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vldist.recipes.base import Recipe

PLUGIN_GROUP = "vldist.recipes"
# name -> "module:Class" (imported on first use) or the class itself (tests register their own)
RECIPES: dict[str, str | type[Recipe]] = {
    "vsrn": "vldist.recipes.vsrn:VSRNRecipe",
    "captioner": "vldist.recipes.captioner:CaptionerRecipe",
    "cl_caption": "vldist.recipes.cl_caption:CLCaptionRecipe",
    "two_branch_embed": "vldist.recipes.two_branch:TwoBranchEmbedRecipe",
    "two_branch_sim": "vldist.recipes.two_branch:TwoBranchSimRecipe",
    "l2c": "vldist.recipes.l2c:L2CRecipe",
    "laviter": "vldist.recipes.laviter:LAViTeRRecipe",
}
BUILT_IN = tuple(RECIPES)


def plugin_recipes() -> dict[str, str]:
    """The recipes installed packages declare: name -> "module:Class" (built-in names win)."""
    return {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP) if ep.name not in BUILT_IN}


def recipe_names() -> list[str]:
    """Every recipe a job may name: the built-in ones, then the plugins'."""
    return [*RECIPES, *(name for name in plugin_recipes() if name not in RECIPES)]


def get_recipe(name: str) -> type[Recipe]:
    entry = RECIPES.get(name) or plugin_recipes().get(name)
    if entry is None:
        raise ValueError(f"unknown recipe '{name}'; recipes: {', '.join(sorted(recipe_names()))}")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"recipe '{name}' names {module}:{attr}, which cannot be imported: {err}") from None
        RECIPES[name] = entry
    if "name" not in vars(entry):  # the key is its name (a subclass does not inherit its parent's)
        entry.name = name
    elif entry.name != name:
        raise ValueError(
            f"recipe '{name}' is the class {entry.__module__}.{entry.__qualname__}, whose name is "
            f"'{entry.name}': a job names a recipe by the key it is registered under, so make the two "
            "the same (or leave `name` out: the key is used)"
        )
    return entry
