"""The recipe contract the platform checks: what evaluate returns (the counts, a flat headline, a
numeric selection score), each breach refused in one line naming the recipe and the field; the
registry key and the recipe's name cannot disagree; the default headline flattens nested metrics."""

import pytest

from vldist.errors import RecipeContractError
from vldist.recipes import RECIPES, get_recipe
from vldist.recipes.base import Recipe
from vldist.recipes.contract import check_evaluation
from vldist.recipes.vsrn import VSRNRecipe

GOOD = {
    "n_images": 4,
    "n_captions": 20,
    "full": {"rsum": 12.5, "i2t_r1": 1.0, "i2t_r5": 2.0, "i2t_r10": 3.0, "t2i_r1": 1.5, "t2i_r5": 2.0, "t2i_r10": 3.0},
}


class Scored:
    """A recipe's evaluation side, as check_evaluation sees it."""

    name = "scored"
    headline = classmethod(Recipe.headline.__func__)

    def __init__(self, score=1.0):
        self.score = score

    def selection_score(self, metrics):
        return self.score


def test_a_whole_evaluation_passes():
    check_evaluation(VSRNRecipe, GOOD, selecting=False)  # headline is a class method: no recipe built
    check_evaluation(Scored(), {"n_images": 0, "n_captions": 0})


@pytest.mark.parametrize(
    ("metrics", "said"),
    [
        ({"n_captions": 5, "r1": 3.0}, "evaluate() returned no 'n_images' (the number of images"),
        ({"n_images": 2, "r1": 3.0}, "evaluate() returned no 'n_captions'"),
        ({"n_images": 2.0, "n_captions": 5}, "evaluate() returned 2.0 as 'n_images'"),
        ({"n_images": True, "n_captions": 5}, "evaluate() returned True as 'n_images'"),
        ([1, 2], "evaluate() returned a list, not a dict"),
    ],
)
def test_an_evaluation_without_its_counts_is_refused_naming_the_recipe_and_the_field(metrics, said):
    with pytest.raises(RecipeContractError) as err:
        check_evaluation(Scored(), metrics)
    message = str(err.value)
    assert message.startswith("recipe 'scored': ") and said in message and "\n" not in message
    assert "docs/adding-a-method.md" in message


def test_a_headline_that_is_not_flat_numbers_and_a_score_that_is_no_number_are_refused():
    class Nested(Scored):
        @classmethod
        def headline(cls, metrics):
            return {"full": metrics["full"]}

    with pytest.raises(
        RecipeContractError,
        match="recipe 'scored': headline.. must return a flat dict of numbers.*'full' is not a number",
    ):
        check_evaluation(Nested(), GOOD)
    with pytest.raises(RecipeContractError, match=r"selection_score\(\) returned None, not a number"):
        check_evaluation(Scored(score=None), GOOD)
    check_evaluation(Scored(score=None), GOOD, selecting=False)  # a test split's result picks nothing


def test_the_default_headline_prints_every_number_flat():
    metrics = {
        "n_images": 4,
        "n_captions": 20,
        "unit": "images",
        "full": {"rsum": 12.5, "deep": {"r1": 2}},
        "flag": True,
        "examples": [{"caption": "a"}],
        "loss": 0.25,
    }
    line = Recipe.headline(metrics)
    assert line == {"full/rsum": 12.5, "full/deep/r1": 2, "loss": 0.25}
    assert " ".join(f"{k} {v:.1f}" for k, v in line.items())  # what the progress line does with it


def test_the_registry_key_is_the_recipes_name_and_a_different_one_is_refused(monkeypatch):
    class Unnamed(VSRNRecipe):
        pass

    class Misnamed(VSRNRecipe):
        name = "vsrn_pool"

    monkeypatch.setitem(RECIPES, "vse_unnamed", Unnamed)
    assert get_recipe("vse_unnamed").name == "vse_unnamed" and VSRNRecipe.name == "vsrn"
    monkeypatch.setitem(RECIPES, "vse_pool", Misnamed)
    with pytest.raises(ValueError, match="recipe 'vse_pool' is the class .*Misnamed, whose name is 'vsrn_pool'"):
        get_recipe("vse_pool")
