import re

import pytest

from vldist.config import parse_overrides
from vldist.errors import ConfigError
from vldist.recipes.jobs import load_config
from vldist.train import usage


def test_default_job_loads_with_typed_values():
    config = load_config("vsrn", [])
    assert config.recipe == "vsrn"
    assert config.model.rrr_layers == 4 and config.model.margin == pytest.approx(0.2)
    assert config.train.grad_clip == pytest.approx(2.0)


def test_dotted_overrides_are_typed():
    config = load_config(
        "vsrn", ["data.batch_size=64", "model.global_reasoning=mean", "train.max_steps=7", "train.grad_clip=null"]
    )
    assert config.data.batch_size == 64
    assert config.model.global_reasoning == "mean"
    assert config.train.max_steps == 7
    assert config.train.grad_clip is None


def test_unknown_key_names_key_suggestion_and_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config("vsrn", ["data.batchsize=64"])
    message = str(err.value)
    assert "unknown key 'data.batchsize'" in message
    assert "Did you mean 'data.batch_size'" in message
    assert "shuffle_buffer" in message  # lists the valid keys of the section


def test_unknown_section_is_reported():
    with pytest.raises(ConfigError, match="unknown key 'trian'"):
        load_config("vsrn", ["trian.lr=0.1"])


def test_bad_choice_names_the_valid_choices():
    with pytest.raises(ConfigError) as err:
        load_config("vsrn", ["model.affinity_norm=cosine"])
    assert "model.affinity_norm" in str(err.value)
    assert "'count'" in str(err.value) and "'softmax'" in str(err.value)


def test_bad_type_and_range_are_reported():
    with pytest.raises(ConfigError, match="data.batch_size"):
        load_config("vsrn", ["data.batch_size=many"])
    with pytest.raises(ConfigError, match="model.rrr_layers"):
        load_config("vsrn", ["model.rrr_layers=-1"])


def test_malformed_override_and_missing_job():
    with pytest.raises(ConfigError, match="section.key=value") as err:
        parse_overrides(["data.batch_size"])
    example = re.search(r"\(e\.g\. (\S+)\)", str(err.value)).group(1)
    assert load_config("vsrn", [example]).data.batch_size == 64  # the example is a key that exists
    with pytest.raises(ConfigError, match="no job file for 'nosuchjob'"):
        load_config("nosuchjob", [])


def test_a_misspelt_job_name_gets_the_closest_one(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"no job file for 'vsrm'\. Did you mean 'vsrn'\? Looked at vsrm, "):
        load_config("vsrm", [])
    monkeypatch.chdir(tmp_path)  # a user's own ./jobs is searched and listed too
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "my_vsrn.yaml").write_text("recipe: vsrn\n")
    with pytest.raises(ConfigError, match=r"Did you mean 'my_vsrn'\?.* Job files: .*my_vsrn"):
        load_config("my_vsr", [])
    assert load_config("my_vsrn", []).recipe == "vsrn"


def test_help_lists_recipes_job_files_and_keys_with_defaults():
    text = usage("vsrn")
    assert "vsrn" in text and "vsrn_coco" in text
    assert "model.rrr_layers = 4" in text
    assert "data.batch_size = 128" in text


@pytest.mark.parametrize("job", ["vsrn", "vsrn_coco", "vsrn_karpathy"])
def test_every_shipped_job_file_validates(job):
    config = load_config(job, [])
    assert config.recipe == "vsrn" and config.data.max_regions >= 5


def test_yes_no_on_off_are_words_and_true_false_booleans():
    """YAML 1.1 reads no/yes/on/off as booleans, which made `engine.mixed_precision=no` (the choice
    named "no") fail as False; only true/false are booleans, as in YAML 1.2."""
    assert parse_overrides(["engine.mixed_precision=no", "a.b=on", "a.c=true", "a.d=False"]) == {
        "engine": {"mixed_precision": "no"},
        "a": {"b": "on", "c": True, "d": False},
    }
    config = load_config("vsrn", ["engine.mixed_precision=no", "eval.baseline=no", "train.sample_log=yes"])
    assert config.engine.mixed_precision == "no"
    assert config.eval.baseline is False and config.train.sample_log is True  # boolean settings still take the words


def test_a_job_file_may_write_no_for_the_choice_named_no(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("recipe: vsrn\nengine:\n  mixed_precision: no\neval:\n  baseline: off\n")
    config = load_config(str(job), [])
    assert config.engine.mixed_precision == "no" and config.eval.baseline is False


def test_storage_options_read_yes_no_on_off_as_booleans_at_any_depth():
    """fsspec takes storage_options untyped: `anon: no` must reach it as False, not as the word
    (which a filesystem testing `if anon:` would take as true)."""
    config = load_config(
        "vsrn",
        [
            "data.storage_options={anon: no, client_kwargs: {verify: OFF, names: [yes, maybe]}}",
            "output.storage_options={anon: On}",
        ],
    )
    assert config.data.storage_options == {"anon": False, "client_kwargs": {"verify": False, "names": [True, "maybe"]}}
    assert config.output.storage_options == {"anon": True}
