"""Recipe registry: one entry per paper method."""

from __future__ import annotations

from vldist.recipes.base import Recipe
from vldist.recipes.captioner import CaptionerRecipe
from vldist.recipes.cl_caption import CLCaptionRecipe
from vldist.recipes.l2c import L2CRecipe
from vldist.recipes.laviter import LAViTeRRecipe
from vldist.recipes.two_branch import TwoBranchEmbedRecipe, TwoBranchSimRecipe
from vldist.recipes.vsrn import VSRNRecipe

RECIPES: dict[str, type[Recipe]] = {
    r.name: r
    for r in (VSRNRecipe, CaptionerRecipe, CLCaptionRecipe, TwoBranchEmbedRecipe, TwoBranchSimRecipe, L2CRecipe,
              LAViTeRRecipe)
}


def get_recipe(name: str) -> type[Recipe]:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe '{name}'; recipes: {', '.join(sorted(RECIPES))}") from None
