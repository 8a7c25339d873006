"""The recipe registry: every built-in recipe by name, built as each rank builds it (the base
constructor's arguments), and names it does not know refused with the list of those it does."""

import pytest

from vldist.data.vocab import Vocab
from vldist.recipes import BUILT_IN, RECIPES, get_recipe, recipe_names
from vldist.recipes.base import Recipe
from vldist.recipes.jobs import load_config


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_recipe_takes_the_runners_arguments(name):
    recipe_cls = get_recipe(name)
    assert issubclass(recipe_cls, Recipe) and recipe_cls.name == name
    config = load_config(name, [])  # each built-in recipe has its job file of the same name
    recipe = recipe_cls(config, Vocab(["red", "circle"]), 8, uniform_shapes=True)
    assert recipe.uniform_shapes and recipe.feature_dim == 8 and recipe.config is config


def test_names_resolve_once_and_unknown_ones_are_refused(monkeypatch):
    monkeypatch.setitem(RECIPES, "vsrn", "vldist.recipes.vsrn:VSRNRecipe")
    first = get_recipe("vsrn")
    assert RECIPES["vsrn"] is first and get_recipe("vsrn") is first  # imported on first use, then kept
    with pytest.raises(ValueError, match="unknown recipe 'nope'; recipes: .*vsrn"):
        get_recipe("nope")
    monkeypatch.setitem(RECIPES, "broken", "vldist.recipes.vsrn:NoSuchRecipe")
    with pytest.raises(ValueError, match="recipe 'broken' names vldist.recipes.vsrn:NoSuchRecipe"):
        get_recipe("broken")
    assert set(BUILT_IN) <= set(recipe_names())


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_recipes_sample_functions_travel_to_a_fork_server_worker(name):
    """Loader workers over shards in a store start from a fork server (data/pipeline.py), which
    receives the stream, and with it the recipe's functions, pickled."""
    import pickle

    from vldist.data.streams import stream_sources

    config = load_config(name, ["data.shards=s3://bucket/set"])
    recipe = get_recipe(name)(config, Vocab(["red", "circle"]), 8, uniform_shapes=True)
    functions = [f for stream in stream_sources(recipe.train_streams(config)) for f in recipe.stream_functions(stream)]
    functions += [recipe.eval_sample, recipe.collate_eval]
    for function in functions:
        copy = pickle.loads(pickle.dumps(function))
        assert copy.__func__ is function.__func__ and copy.__self__ is not recipe
        assert copy.__self__.config == config and type(copy.__self__.config) is type(config)
        assert copy.__self__.vocab.itos == recipe.vocab.itos
