"""Typed config: unknown keys suggest the nearest valid key, bad values name field and range."""

import tomllib
from pathlib import Path

import pytest

from jdqn.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    dumps_toml,
    load_config,
)

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))


def test_defaults_build():
    cfg = config_from_dict({})
    assert cfg == Config()
    assert cfg.model.branch_sizes == (4, 3, 3, 3)
    assert cfg.features.state_width == 128


def test_unknown_key_names_nearest_valid_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.lrr'; did you mean 'train.lr'"):
        config_from_dict({"train": {"lrr": 1e-3}})


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'; did you mean 'model'"):
        config_from_dict({"modle": {}})


def test_out_of_range_names_field_and_range():
    with pytest.raises(ConfigError, match=r"model.n_atoms = 1 is out of range; allowed: \[2, inf\)"):
        config_from_dict({"model": {"n_atoms": 1}})
    with pytest.raises(ConfigError, match=r"train.gamma = 1.5 is out of range; allowed: \[0, 1\]"):
        config_from_dict({"train": {"gamma": 1.5}})


def test_wrong_type_and_choice():
    with pytest.raises(ConfigError, match=r"train.batch_size = 'big' has the wrong type; expected an integer"):
        config_from_dict({"train": {"batch_size": "big"}})
    with pytest.raises(ConfigError, match=r"data.source = 'csv' is not allowed; allowed values: 'synthetic'"):
        config_from_dict({"data": {"source": "csv"}})
    with pytest.raises(ConfigError, match=r"train.batch_size = True has the wrong type"):
        config_from_dict({"train": {"batch_size": True}})


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="v_min"):
        config_from_dict({"model": {"v_min": 1.0, "v_max": 0.0}})
    with pytest.raises(ConfigError, match="branch_sizes"):
        config_from_dict({"model": {"branch_sizes": [4, 3, 3]}})


def test_train_cross_field_checks():
    with pytest.raises(ConfigError, match=r"min_replay = 5000 > train.replay_capacity = 4000"):
        config_from_dict({"train": {"min_replay": 5000, "replay_capacity": 4000}})
    with pytest.raises(ConfigError, match=r"seed\(s\) \[1\] repeated"):
        config_from_dict({"train": {"seeds": [1, 2, 1]}})
    config_from_dict({"train": {"min_replay": 4000, "replay_capacity": 4000, "seeds": [2, 1]}})


def test_config_that_is_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "latin1.toml"
    p.write_bytes("[data]\nsource = 'synth\u00e9tique'\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.toml: not a UTF-8 text file"):
        load_config(p)


def test_overrides_parse_toml_literals_and_bare_strings():
    t = apply_overrides({}, ["train.lr=1e-3", "train.seeds=[1, 2]", "data.source=ticks",
                             "logging.progress=false"])
    cfg = config_from_dict(t)
    assert cfg.train.lr == 1e-3 and cfg.train.seeds == (1, 2)
    assert cfg.data.source == "ticks" and cfg.logging.progress is False
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["train.lr"])


def test_resolved_config_round_trips():
    cfg = config_from_dict({"train": {"seeds": [3, 4]}, "model": {"width": 32}})
    assert config_from_dict(tomllib.loads(dumps_toml(cfg))) == cfg


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_invalid_toml_names_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[train\nlr = 1")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        load_config(p)


def test_unavailable_data_parallel_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="parallel.n_devices = 4.*not available"):
        config_from_dict({"parallel": {"n_devices": 4}})
