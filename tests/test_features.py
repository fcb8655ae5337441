"""Features against plain sequential references; the layout of the feature matrix; the
normaliser (fitted on its window only); the observation layout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from jdqn.config import FeaturesConfig, SyntheticConfig
from jdqn.data import (
    PORTFOLIO_SLOTS,
    StateLayout,
    build_features,
    fit_normaliser,
    generate_synthetic,
    warmup_rows,
)
from jdqn.data.features import cusum, ema, rolling_extreme, rolling_sum
from jdqn.errors import DataError

RNG = np.random.default_rng(0)


def _cusum_loop(z: np.ndarray, h: float):
    sp, sn, ev = np.zeros_like(z), np.zeros_like(z), np.zeros_like(z)
    p = n = 0.0
    for t, x in enumerate(z):
        p = max(p + x, 0.0)
        if p > h:
            p, ev[t] = 0.0, 1.0
        n = max(n + (-x), 0.0)
        if n > h:
            n, ev[t] = 0.0, -1.0
        sp[t], sn[t] = p, -n
    return sp, sn, ev


@pytest.mark.parametrize("chunk", [0, 3, 16, 997])
def test_cusum_equals_the_sequential_recursion_bitwise(chunk: int) -> None:
    z = RNG.standard_normal(5000) * 0.7 + 0.05
    z[1000:1400] = 0.3  # a long drift: the state does not forget quickly here
    for got, want in zip(cusum(z, 2.0, chunk=chunk), _cusum_loop(z, 2.0), strict=True):
        np.testing.assert_array_equal(got, want)


def test_ema_equals_the_bias_corrected_recursion() -> None:
    x = RNG.standard_normal(3000) + 1.0
    a = 1 / 14
    y, out = 0.0, np.empty_like(x)
    for t, v in enumerate(x):
        y = (1 - a) * y + a * v
        out[t] = y / (1 - (1 - a) ** (t + 1))
    np.testing.assert_allclose(ema(x, a), out, rtol=1e-12, atol=1e-14)


def test_rolling_helpers_match_pandas() -> None:
    x = RNG.standard_normal(500)
    s = pd.Series(x)
    np.testing.assert_allclose(rolling_sum(x, 7)[6:], s.rolling(7).sum()[6:], atol=1e-12)
    np.testing.assert_array_equal(rolling_extreme(x, 5, np.maximum)[4:], s.rolling(5).max()[4:])
    np.testing.assert_array_equal(rolling_extreme(x, 5, np.minimum)[4:], s.rolling(5).min()[4:])


def _bars(n: int = 3000, seed: int = 0):
    return generate_synthetic(SyntheticConfig(n_bars=n, seed=seed))


def test_feature_values_follow_their_formulas() -> None:
    b = _bars()
    cfg = FeaturesConfig()
    f = build_features(b, cfg)
    col = {n: f.values[:, j].astype(np.float64) for j, n in enumerate(f.names)}
    w = f.warmup
    lc = pd.Series(np.log(b.close))
    r1 = lc.diff()
    close = lambda a, e: np.testing.assert_allclose(a[w:], np.asarray(e)[w:], rtol=2e-6,
                                                    atol=2e-7)
    for k in cfg.return_lags:
        close(col[f"ret_{k}"], lc.diff(k))
    for v in cfg.vol_windows:
        close(col[f"rvol_{v}"], np.sqrt((r1 ** 2).rolling(v).mean()))
    close(col["range"], (b.high - b.low) / b.close)
    lv = pd.Series(np.log1p(b.volume))
    wz = cfg.volume_z_window
    close(col["volume_z"], (lv - lv.rolling(wz).mean()) / lv.rolling(wz).std(ddof=0))
    for m in cfg.mtf_factors:
        rm = lc.diff(m)
        close(col[f"mtf_ret_{m}"], rm)
        sq = sum((rm ** 2).shift(j * m) for j in range(cfg.vol_windows[0]))
        close(col[f"mtf_vol_{m}"], np.sqrt(sq / cfg.vol_windows[0]))
    close(col["log_duration"], np.full(len(b), np.log(60.0)))
    tod = (b.ts % (86400 * 10**9)) / (86400 * 10**9)
    close(col["tod_sin"], np.sin(2 * np.pi * tod))
    imb = (b.buy_volume - b.sell_volume) / b.volume
    close(col["flow_imb"], imb)
    sv = pd.Series(b.buy_volume - b.sell_volume).rolling(cfg.ofi_window).sum()
    close(col[f"flow_imb_{cfg.ofi_window}"], sv / pd.Series(b.volume).rolling(cfg.ofi_window).sum())
    # ±DI and ADX against a plain Wilder loop (bias-corrected start, as documented)
    n = cfg.adx_period
    sm = {"tr": 0.0, "p": 0.0, "m": 0.0, "adx": 0.0}
    pdi, adx = np.zeros(len(b)), np.zeros(len(b))
    for t in range(len(b)):
        pc = b.close[t - 1] if t else b.close[0]
        up = b.high[t] - b.high[t - 1] if t else 0.0
        dn = b.low[t - 1] - b.low[t] if t else 0.0
        tr = max(b.high[t] - b.low[t], abs(b.high[t] - pc), abs(b.low[t] - pc))
        sm["tr"] += (tr - sm["tr"]) / n
        sm["p"] += ((up if up > dn and up > 0 else 0.0) - sm["p"]) / n
        sm["m"] += ((dn if dn > up and dn > 0 else 0.0) - sm["m"]) / n
        p, m = sm["p"] / sm["tr"], sm["m"] / sm["tr"]
        dx = abs(p - m) / (p + m) if p + m > 0 else 0.0
        sm["adx"] += (dx - sm["adx"]) / n
        pdi[t], adx[t] = p, sm["adx"] / (1 - (1 - 1 / n) ** (t + 1))
    close(col["plus_di"], pdi)
    close(col["adx"], adx)


def test_layout_warmup_and_finiteness() -> None:
    b = _bars()
    f = build_features(b, FeaturesConfig())
    assert f.values.dtype == np.float32 and f.values.shape == (len(b), len(f.names))
    assert len(set(f.names)) == len(f.names)
    assert f.warmup == warmup_rows(FeaturesConfig()) == 165
    assert np.isfinite(f.values).all()
    assert (f.values[: f.warmup] == 0).all()
    assert [f.names[i] for i in f.flow_idx] == ["flow_imb", "flow_imb_10"]
    no_tod = build_features(b, FeaturesConfig(time_of_day=False))
    assert no_tod.n_features == f.n_features - 2 and "tod_sin" not in no_tod.names


def test_missing_flow_is_zero_filled_with_the_same_layout() -> None:
    b = _bars()
    nan = np.full(len(b), np.nan)
    f0 = build_features(b, FeaturesConfig())
    f1 = build_features(dataclasses.replace(b, buy_volume=nan, sell_volume=nan), FeaturesConfig())
    assert f1.names == f0.names and f1.flow_idx == f0.flow_idx
    assert (f1.values[:, list(f1.flow_idx)] == 0).all()


def test_too_few_bars_is_a_clear_error() -> None:
    with pytest.raises(DataError, match="too few"):
        build_features(_bars(160), FeaturesConfig())


# --------------------------------------------------------------------------------------------
# normaliser
# --------------------------------------------------------------------------------------------


def test_normaliser_uses_only_its_window() -> None:
    x = RNG.standard_normal((1000, 3)) * [1.0, 10.0, 0.1] + [0.0, 5.0, -1.0]
    n0 = fit_normaliser(x, 200, 600)
    y = x.copy()
    y[:200] = 1e6
    y[600:] = -1e6
    n1 = fit_normaliser(y, 200, 600)
    np.testing.assert_array_equal(n0.center, n1.center)
    np.testing.assert_array_equal(n0.scale, n1.scale)
    np.testing.assert_allclose(n0.center, np.median(x[200:600], axis=0))
    q = np.percentile(x[200:600], [25, 75], axis=0)
    np.testing.assert_allclose(n0.scale, (q[1] - q[0]) / 1.3489795003921634)
    out = n1.apply(y)
    assert out.dtype == np.float32 and out.max() == 5.0 and out.min() == -5.0
    z = fit_normaliser(x, 0, 1000, method="zscore", clip=3.0)
    np.testing.assert_allclose(z.center, x.mean(axis=0))
    assert np.abs(z.apply(x)).max() <= 3.0


def test_normaliser_degenerate_scales_fall_back() -> None:
    x = np.zeros((100, 3))
    x[:, 1] = np.where(np.arange(100) % 10 == 0, 1.0, 0.0)  # IQR 0, std > 0
    x[:, 2] = 7.0  # constant
    n = fit_normaliser(x, 0, 100)
    assert n.scale[0] == 1.0 and n.scale[2] == 1.0
    np.testing.assert_allclose(n.scale[1], x[:, 1].std())
    with pytest.raises(ValueError, match="lo"):
        fit_normaliser(x, 50, 50)


# --------------------------------------------------------------------------------------------
# observation layout
# --------------------------------------------------------------------------------------------


def test_state_layout() -> None:
    lay = StateLayout(n_features=24, width=128)
    assert lay.portfolio_offset == 24 and lay.n_portfolio == 7 and lay.n_padding == 97
    assert lay.slot("position") == 24 and lay.slot("last_direction") == 27
    assert lay.slot("order_distance") == 30
    names = lay.column_names(tuple(f"f{i}" for i in range(24)))
    assert len(names) == 128 and names[24:31] == PORTFOLIO_SLOTS and names[-1] == "pad_96"
    obs = lay.assemble(np.ones((5, 24), np.float32), np.full((5, 7), 2.0))
    assert obs.shape == (5, 128) and obs.dtype == np.float32
    assert (obs[:, 24:31] == 2).all() and (obs[:, 31:] == 0).all()
    StateLayout(n_features=121, width=128)
    with pytest.raises(ValueError, match="state_width = 128 is too small"):
        StateLayout(n_features=122, width=128)


def test_auto_state_width_is_the_used_columns_rounded_up_to_eight() -> None:
    from jdqn.config import ConfigError
    from jdqn.data import resolve_state_width

    assert [resolve_state_width(f, "auto") for f in (0, 1, 24, 25, 26, 33, 121, 122)] == [
        8, 8, 32, 32, 40, 40, 128, 136]
    assert resolve_state_width(24, 128) == 128 and resolve_state_width(24, 31) == 31
    for bad in ("wide", True, 31.0):
        with pytest.raises(ConfigError, match="expected an integer or 'auto'"):
            resolve_state_width(24, bad)


def test_a_job_with_auto_state_width_observes_and_trains_on_that_width() -> None:
    """``features.state_width = "auto"`` end to end: the job's layout, the env's observations
    and the network's input layers all take the resolved width (26 features + 7 portfolio
    slots → 40), the observation holding the layout's columns and zeros in the rest."""
    import jax
    from helpers import tiny_config

    from jdqn.env import core as env_core
    from jdqn.train import job as job_lib

    lags = "features.return_lags=[1, 2, 3, 5, 10, 20, 40]"  # 26 features
    cfg = tiny_config('features.state_width="auto"', lags)
    p = job_lib.prepare(cfg)
    assert p.feats.n_features == 26 and p.layout.width == 40 and p.layout.n_padding == 7
    env = job_lib.fold_env_params(cfg, p, 0)
    obs = np.asarray(env_core.observe(env, env_core.reset(env, jax.random.key(0), 4)))
    assert obs.shape == (4, 40) and (obs[:, 33:] == 0).all() and (obs[:, :26] != 0).any()
    params = p.learner.net.init(jax.random.key(1), obs)["params"]
    assert params["trunk"]["proj"]["kernel"].shape[0] == 40
    assert job_lib.prepare(tiny_config("features.state_width=128", lags)).layout.width == 128
