"""Report folder: files, keys, columns; returns.csv reproduces report.json's metrics."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from jdqn import env as E
from jdqn.config import EnvConfig, EvalConfig
from jdqn.evaluate import metrics as M
from jdqn.evaluate import rollout, run_baselines, write_report
from jdqn.evaluate.baselines import momentum_policy

REQUIRED = ("sharpe", "sortino", "calmar", "max_drawdown", "total_return",
            "annualization_periods", "n_bars", "n_trades")


@pytest.fixture(scope="module")
def backtests():
    rng = np.random.default_rng(0)
    t_len = 300
    c = 4000 + np.round(np.cumsum(rng.normal(0, 2, t_len)) * 4) / 4
    o = np.r_[c[0], c[:-1]]
    params = E.make_params(rng.normal(size=(t_len, 5)), o, np.maximum(o, c) + 0.25,
                           np.minimum(o, c) - 0.25, c, EnvConfig(), state_width=16)
    eval_cfg = EvalConfig(momentum_lookback=5)
    strategy = rollout(params, momentum_policy, jnp.int32(10), lo=50, hi=300)
    baselines = run_baselines(params, eval_cfg, lo=50, hi=300)
    ts = (np.datetime64("2024-01-02T00:00") + strategy.bar * np.timedelta64(1, "m"))
    return ts.astype("datetime64[ns]").astype(np.int64), strategy, baselines


def test_report_files_keys_and_columns(tmp_path, backtests):
    ts, strategy, baselines = backtests
    ppy = M.periods_per_year(60, EvalConfig())
    folds = [{"fold": 0, "sharpe": 1.2, "total_return": 0.01, "max_drawdown": -0.02}]
    report = write_report(tmp_path, ts, strategy, baselines, folds, ppy, {"seed": 0})
    for f in ("report.json", "returns.csv", "summary.md", "plots/equity.png",
              "plots/drawdown.png", "plots/position.png", "plots/actions.png"):
        assert (tmp_path / f).is_file() and (tmp_path / f).stat().st_size > 0, f
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk == report
    assert all(k in on_disk["test"] for k in REQUIRED)
    assert set(on_disk["baselines"]) == {"flat", "buy_and_hold", "momentum", "random"}
    for m in on_disk["baselines"].values():
        assert all(k in m for k in REQUIRED)
    assert on_disk["folds"] == folds
    assert on_disk["test"]["n_bars"] == strategy.n_bars == 249
    df = pd.read_csv(tmp_path / "returns.csv")
    for col in ("timestamp", "strategy_return", "position", "flat_return",
                "buy_and_hold_return", "momentum_return", "random_return"):
        assert col in df.columns, col
    assert len(df) == strategy.n_bars
    assert pd.to_datetime(df["timestamp"]).is_monotonic_increasing
    text = (tmp_path / "summary.md").read_text()
    assert "| strategy |" in text and "mean_abs_position |" in text
    # 249 one-minute bars: the summary warns that annualised returns are extrapolations, and
    # labels the validation figures as the selected (biased) ones.
    assert f"The window is {249 / ppy:.2%} of a year" in text
    assert "biased upwards" in text and "same sizing chain" in text
    write_report(tmp_path / "long", ts, strategy, baselines, folds, M.PeriodsPerYear(100.0, 1))
    assert "of a year" not in (tmp_path / "long" / "summary.md").read_text()


def test_returns_csv_reproduces_the_reported_sharpe(tmp_path, backtests):
    ts, strategy, baselines = backtests
    report = write_report(tmp_path, ts, strategy, baselines, [], 98_280.0)
    df = pd.read_csv(tmp_path / "returns.csv")
    ppy = report["test"]["annualization_periods"]
    for col, m in [("strategy_return", report["test"]),
                   ("momentum_return", report["baselines"]["momentum"])]:
        r = df[col].to_numpy()
        assert np.sqrt(ppy) * r.mean() / r.std(ddof=1) == pytest.approx(m["sharpe"], rel=1e-12)
        assert np.prod(1 + r) - 1 == pytest.approx(m["total_return"], rel=1e-12)
    assert report["baselines"]["flat"]["sharpe"] is None  # NaN → null in JSON


def test_seed_summary_aggregates_per_seed_test_metrics(tmp_path, backtests):
    from jdqn.evaluate import write_seed_summary

    ts, strategy, baselines = backtests
    r0 = write_report(tmp_path / "a", ts, strategy, baselines, [], 98_280.0)
    r1 = write_report(tmp_path / "b", ts, baselines["random"], baselines, [], 98_280.0)
    top = tmp_path / "a"
    summary = write_seed_summary(top, [7, 9], [r0, r1])
    assert json.loads((top / "seeds.json").read_text()) == summary
    sharpes = [r0["test"]["sharpe"], r1["test"]["sharpe"]]
    assert summary["test"]["7"]["sharpe"] == sharpes[0] and summary["test"]["9"]["sharpe"] == sharpes[1]
    agg = summary["aggregate"]["sharpe"]
    assert agg["mean"] == pytest.approx(np.mean(sharpes))
    assert agg["std"] == pytest.approx(np.std(sharpes, ddof=1))
    assert (agg["min"], agg["max"], agg["n"]) == (min(sharpes), max(sharpes), 2)
    text = (top / "summary.md").read_text()
    assert text.startswith("# Out-of-sample report") and "## Across seeds" in text
    with pytest.raises(ValueError, match="≥ 2 seeds"):
        write_seed_summary(top, [7], [r0])


def test_seed_summary_counts_the_seeds_behind_each_statistic(tmp_path, backtests):
    """A seed whose Sharpe is undefined (it never held a position: the flat policy) is left out
    of the Sharpe column's statistics; summary.md shows n, min and max beside mean and std, as
    seeds.json does, and says that seeds were left out."""
    from jdqn.evaluate import write_seed_summary

    ts, strategy, baselines = backtests
    reports = [write_report(tmp_path / name, ts, result, baselines, [], 98_280.0)
               for name, result in (("a", strategy), ("b", baselines["random"]),
                                    ("c", baselines["flat"]))]
    assert reports[2]["test"]["sharpe"] is None
    summary = write_seed_summary(tmp_path / "a", [1, 2, 3], reports)
    agg = summary["aggregate"]["sharpe"]
    assert agg["n"] == 2
    assert agg["mean"] == pytest.approx(np.mean([r["test"]["sharpe"] for r in reports[:2]]))
    text = (tmp_path / "a" / "summary.md").read_text().split("## Across seeds")[1]
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert {"mean", "std", "min", "max", "n"} <= rows.keys()
    col = rows["seed"].split("|").index(" sharpe ")
    assert rows["n"].split("|")[col].strip() == "2"
    assert rows["3"].split("|")[col].strip() == "–"
    assert "leave out the seeds where its metric is undefined" in text


def test_walk_forward_table_takes_columns_from_any_fold(tmp_path, backtests):
    """Fold 0 without validation metrics (its seed never reached min_replay) does not empty the
    walk-forward table: fold 1's figures are shown."""
    ts, strategy, baselines = backtests
    folds = [{"fold": 0, "epochs": 1},
             {"fold": 1, "epochs": 2, "sharpe": 2.5, "total_return": 0.01, "max_drawdown": 0.02}]
    write_report(tmp_path, ts, strategy, baselines, folds, 98_280.0)
    text = (tmp_path / "summary.md").read_text().split("## Walk-forward validation")[1]
    assert "| fold | sharpe | total_return | max_drawdown |" in text
    assert "| 1 | 2.5 | 0.01 | 0.02 |" in text and "| 0 | – | – | – |" in text


def test_without_timestamps_the_report_is_indexed_by_bar_number(tmp_path, backtests):
    """``write_report(…, timestamps=None, …)``: the files are indexed by the bars' numbers in
    the original series (``strategy.bar``: here 51…299), not by row numbers 0…n−1."""
    _, strategy, baselines = backtests
    report = write_report(tmp_path, None, strategy, baselines, [], 98_280.0)
    df = pd.read_csv(tmp_path / "returns.csv")
    assert df.columns[0] == "bar" and list(df.columns).count("bar") == 1
    assert "timestamp" not in df.columns
    assert (df["bar"].to_numpy() == strategy.bar).all() and strategy.bar[0] == 51
    period = report["period"]
    assert period["start"] == str(period["first_bar"]) == "51"
    assert period["end"] == str(period["last_bar"]) == str(int(strategy.bar[-1]))
    assert f"period 51 → {int(strategy.bar[-1])}" in (tmp_path / "summary.md").read_text()
