"""Typed config: unknown keys suggest the nearest valid key, bad values name field and range."""

import re
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
    # With a likely key the message stays short; without one it lists the section's keys.
    with pytest.raises(ConfigError) as e:
        config_from_dict({"train": {"lrr": 1e-3}})
    assert "valid keys" not in str(e.value)
    with pytest.raises(ConfigError, match=r"unknown config key 'eval.qqqqq' \(valid keys here: "
                                          r".*n_windows.*stride"):
        config_from_dict({"eval": {"qqqqq": 1}})


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'; did you mean 'model'"):
        config_from_dict({"modle": {}})


def test_out_of_range_names_field_and_range():
    with pytest.raises(ConfigError, match=r"model.n_atoms = 1 is out of range; allowed: \[2, 2147483647\]"):
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


@pytest.mark.parametrize("name", ["return_lags", "vol_windows", "mtf_factors"])
def test_a_repeated_feature_setting_is_refused(name):
    with pytest.raises(ConfigError, match=rf"features.{name} = \[5, 2, 5\]: \[5\] repeated"):
        config_from_dict({"features": {name: [5, 2, 5]}})


def test_train_cross_field_checks():
    with pytest.raises(ConfigError, match=r"min_replay = 5000 > train.replay_capacity = 4000"):
        config_from_dict({"train": {"min_replay": 5000, "replay_capacity": 4000}})
    with pytest.raises(ConfigError, match=r"seed\(s\) \[1\] repeated"):
        config_from_dict({"train": {"seeds": [1, 2, 1]}})
    config_from_dict({"train": {"min_replay": 4000, "replay_capacity": 4000, "seeds": [2, 1]}})
    # shares of different spans (the pre-test span, the usable span): any pair plans folds
    config_from_dict({"train": {"train_frac": 0.8, "test_frac": 0.2}})


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


def test_data_file_with_synthetic_source_is_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"data.path = 'x.csv' set, but data.source = "
                                          r"'synthetic' reads no file"):
        config_from_dict({"data": {"path": "x.csv"}})
    with pytest.raises(ConfigError, match=r"data.columns set, but data.source = 'synthetic'"):
        config_from_dict({"data": {"source": "synthetic", "columns": {"price": "px"}}})
    for source in ("ticks", "ohlcv", "dbn"):
        config_from_dict({"data": {"source": source, "path": "x.csv",
                                   "columns": {"price": "px"}}})


def test_synthetic_market_on_another_tick_than_the_env_is_refused():
    with pytest.raises(ConfigError, match=r"data.synthetic.tick_size = 0.01 but env.tick_size "
                                          r"= 0.25"):
        config_from_dict({"data": {"synthetic": {"tick_size": 0.01}}})
    config_from_dict({"data": {"synthetic": {"tick_size": 0.01}}, "env": {"tick_size": 0.01}})
    # a file's prices are checked against env.tick_size when they are loaded (job.prepare)
    config_from_dict({"data": {"source": "ohlcv", "path": "x.csv",
                               "synthetic": {"tick_size": 0.01}}})


def test_min_replay_that_fold_0_cannot_reach_is_refused():
    # 2 × 5 × 4 = 40 steps per env: 2 still in the n-step window (n = 3), 40 // 8 = 5 forced
    # liquidations (8-step episodes) → 33 sampleable per env, × 8 envs = 264.
    small = {"epochs_per_fold": 2, "iters_per_epoch": 5, "collect_steps": 4, "n_step": 3}
    env = {"n_envs": 8, "episode_length": 8}
    with pytest.raises(ConfigError, match=r"train.min_replay = 265 can never be reached in "
                                          r"fold 0.* = 40 steps .* 5 are forced .* at most 264 "):
        config_from_dict({"train": {**small, "min_replay": 265}, "env": env})
    config_from_dict({"train": {**small, "min_replay": 264}, "env": env})
    # Under "terminal" the forced steps are transitions: 38 × 8 = 304.
    term = {**small, "episode_end": "terminal"}
    config_from_dict({"train": {**term, "min_replay": 304}, "env": env})
    with pytest.raises(ConfigError, match=r"at most 304 "):
        config_from_dict({"train": {**term, "min_replay": 305}, "env": env})


def test_test_helper_config_is_valid():
    from helpers import tiny_config

    tiny_config()


@pytest.mark.parametrize("key", ["env.initial_equity", "eval.periods_per_year", "model.v_max",
                                 "data.synthetic.base_vol", "data.price_scale", "train.lr"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_numbers_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"{key} = .* is not a finite number"):
        config_from_dict(apply_overrides({}, [f"{key}={value}"]))


def test_number_beyond_float_range_is_refused():
    with pytest.raises(ConfigError, match=r"train.lr = 1000+ is too large"):
        config_from_dict({"train": {"lr": 10**400}})


def test_sizes_and_seeds_have_upper_bounds():
    with pytest.raises(ConfigError, match=r"data.synthetic.n_bars = 99999999999999999999 is out "
                                          r"of range; allowed: \[200, 1000000000\]"):
        config_from_dict(apply_overrides({}, ["data.synthetic.n_bars=99999999999999999999"]))
    with pytest.raises(ConfigError, match=r"train.seeds\[1\] = 18446744073709551616 is out of "
                                          r"range; allowed: \[0, 4294967296\)"):
        config_from_dict({"train": {"seeds": [0, 2**64]}})
    with pytest.raises(ConfigError, match=r"eval.random_seed = 4294967296 is out of range"):
        config_from_dict({"eval": {"random_seed": 2**32}})
    config_from_dict({"train": {"seeds": [0, 2**32 - 1]}, "eval": {"random_seed": 2**32 - 1}})


def test_sizes_beyond_int32_branches_the_env_lacks_and_an_overlong_synthetic_span_are_refused():
    """Each used to pass validation and fail after the run folder existed: an int32 overflow
    deep in JAX (or an XLA abort) for a huge size, an 'action out of range' after a whole
    epoch for a fifth magnitude, 'timestamps not ascending' for a synthetic span past 2262."""
    for key, sub in (("env", "n_envs"), ("train", "batch_size"), ("model", "n_atoms")):
        with pytest.raises(ConfigError, match=rf"{key}.{sub} = 10000000000 is out of range; "
                                              r"allowed: \[\d+, 2147483647\]"):
            config_from_dict({key: {sub: 10**10}})
    config_from_dict({"data": {"synthetic": {"seed": 2**40}}})  # a seed is no size
    config_from_dict({"train": {"seeds": [2**32 - 1]}})
    for i, name in ((1, "magnitude"), (2, "order type"), (3, "urgency")):
        sizes = [4, 3, 3, 3]
        sizes[i] = 4
        with pytest.raises(ConfigError, match=rf"model.branch_sizes\[{i}\] = 4: the env has 3 "
                                              rf"{name} actions"):
            config_from_dict({"model": {"branch_sizes": sizes}})
    config_from_dict({"model": {"branch_sizes": [4, 2, 1, 3]}})  # fewer is fine
    with pytest.raises(ConfigError, match=r"data.synthetic.n_bars × data.synthetic.bar_seconds "
                                          r"= 3000 × 100000000 s spans more than"):
        config_from_dict({"data": {"synthetic": {"n_bars": 3000, "bar_seconds": 10**8}}})


def test_state_width_too_small_for_the_features_is_refused():
    with pytest.raises(ConfigError, match=r"features.state_width = 30 is too small: 24 features "
                                          r"\+ 7 portfolio slots need 31"):
        config_from_dict({"features": {"state_width": 30}})
    config_from_dict({"features": {"state_width": 31}})
    config_from_dict({"features": {"state_width": 19, "return_lags": [], "vol_windows": [1],
                                   "mtf_factors": [], "time_of_day": False}})
    with pytest.raises(ConfigError, match=r"features.vol_windows = \[\]: give at least one"):
        config_from_dict({"features": {"vol_windows": []}})


def test_state_width_may_be_auto_and_nothing_else_by_name():
    """``"auto"`` sizes the observation from the features (jdqn.data.resolve_state_width), so
    the too-small check is the layout's; any other string, a float or a bool is refused by
    name, as is a width below 8."""
    cfg = config_from_dict({"features": {"state_width": "auto", "return_lags": list(range(1, 99))}})
    assert cfg.features.state_width == "auto"
    assert apply_overrides({}, ["features.state_width=auto"]) == {
        "features": {"state_width": "auto"}}
    for bad in ("wide", 64.0, True):
        with pytest.raises(ConfigError, match=r"features.state_width = .* has the wrong type; "
                                              r"expected an integer or 'auto'"):
            config_from_dict({"features": {"state_width": bad}})
    with pytest.raises(ConfigError, match=r"features.state_width = 4 is out of range"):
        config_from_dict({"features": {"state_width": 4}})


def test_feature_count_matches_the_features_built():
    from jdqn.config import N_PORTFOLIO_SLOTS, FeaturesConfig, SyntheticConfig, n_base_features
    from jdqn.data import PORTFOLIO_SLOTS, build_features, generate_synthetic

    assert len(PORTFOLIO_SLOTS) == N_PORTFOLIO_SLOTS  # the count _validate assumes
    bars = generate_synthetic(SyntheticConfig(n_bars=400))
    for cfg in (FeaturesConfig(), FeaturesConfig(return_lags=(1,), vol_windows=(3, 5, 7),
                                                 mtf_factors=(), time_of_day=False)):
        assert n_base_features(cfg) == build_features(bars, cfg).n_features


def test_set_table_merges_into_the_table():
    table = {"data": {"synthetic": {"seed": 7, "n_bars": 300}, "cache_dir": ""}}
    t = apply_overrides(table, ["data.synthetic={n_bars=5000}", "data={bar_size='5min'}"])
    assert t == {"data": {"synthetic": {"seed": 7, "n_bars": 5000}, "cache_dir": "",
                          "bar_size": "5min"}}
    assert table["data"]["synthetic"]["n_bars"] == 300  # the input is not modified
    cfg = config_from_dict(t)
    assert cfg.data.synthetic.seed == 7 and cfg.data.synthetic.n_bars == 5000


def test_relative_data_path_in_two_places_is_refused(tmp_path, monkeypatch):
    from jdqn.config import load_config

    cfgdir, cwd = tmp_path / "cfgdir", tmp_path / "cwd"
    for d in (cfgdir, cwd):
        d.mkdir()
        (d / "rel.csv").write_text(f"ts,price,size\n{d.name}\n")
    cfg = cfgdir / "c.toml"
    cfg.write_text('[data]\nsource = "ticks"\npath = "rel.csv"\n')
    monkeypatch.chdir(cwd)
    with pytest.raises(ConfigError, match="ambiguous: both"):
        load_config(str(cfg))
    (cwd / "rel.csv").unlink()  # only the config's folder has it: taken from there
    assert load_config(str(cfg)).data.path == str(cfgdir / "rel.csv")


def test_iqn_fractions_mode_is_checked():
    assert config_from_dict({}).model.iqn_taus == "batch"
    assert config_from_dict({"model": {"iqn_taus": "sample"}}).model.iqn_taus == "sample"
    with pytest.raises(ConfigError, match=r"model.iqn_taus = 'row' is not allowed; allowed "
                                          r"values: 'batch', 'sample'"):
        config_from_dict({"model": {"iqn_taus": "row"}})


def test_iqn_fraction_groups_must_divide_each_devices_batch():
    assert config_from_dict({}).model.iqn_tau_groups == 8
    ok = {"model": {"iqn_tau_groups": 8}, "train": {"batch_size": 256}}
    with pytest.raises(ConfigError, match=r"model.iqn_tau_groups = 8 does not divide "
                                          r"train.batch_size = 100"):
        config_from_dict({**ok, "train": {"batch_size": 100}})
    # the groups matter only for fractions shared by groups of an IQN head's batch
    for model in ({"iqn_taus": "sample"}, {"iqn": False}):
        config_from_dict({"model": model, "train": {"batch_size": 100}})
    assert config_from_dict({"model": {"iqn_tau_groups": 1},
                             "train": {"batch_size": 100}}).model.iqn_tau_groups == 1
    with pytest.raises(ConfigError, match=r"model.iqn_tau_groups = 0 is out of range; "
                                          r"allowed: \[1, 2147483647\]"):
        config_from_dict({"model": {"iqn_tau_groups": 0}})
    # data parallel: each device cuts its own share (256 / 4 = 64) into the groups
    config_from_dict({**ok, "parallel": {"n_devices": 4}})
    with pytest.raises(ConfigError, match=r"parallel.n_devices = 64: each device's batch, "
                                          r"train.batch_size / 64 = 4, is not divisible by "
                                          r"model.iqn_tau_groups = 8"):
        config_from_dict({**ok, "parallel": {"n_devices": 64},
                          "env": {"n_envs": 64}, "train": {"batch_size": 256,
                                                           "replay_capacity": 64 * 1000,
                                                           "min_replay": 1000}})


def test_the_retired_popart_name_points_to_zscore():
    with pytest.raises(ConfigError, match=r"env.reward_norm = 'popart' is not allowed; allowed "
                                          r"values: 'robust', 'zscore', 'none' \('popart' was "
                                          r"renamed 'zscore'"):
        config_from_dict({"env": {"reward_norm": "popart"}})
    assert config_from_dict({"env": {"reward_norm": "zscore"}}).env.reward_norm == "zscore"


@pytest.mark.parametrize("data,fragment", [
    ({"bar_size": "0min"}, "data.bar_size = '0min': time bars must be between 1s and 1d"),
    ({"bar_size": "1M"}, "data.bar_size = '1M': 'M' is ambiguous"),
    ({"timezone": "Mars/Olympus"}, "data.timezone = 'Mars/Olympus' is not a time zone"),
    ({"timezone": "America"}, "data.timezone = 'America' is not a time zone")])
def test_data_settings_are_checked_with_the_config_whatever_the_source(data, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        config_from_dict({"data": data})  # synthetic: they used to pass unread
    for tz in ("America/Chicago", "utc", "+01:00"):  # what the loaders accept
        config_from_dict({"data": {"bar_size": "5m", "timezone": tz}})

