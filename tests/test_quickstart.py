"""The shipped quickstart trains for real: it beats the flat and random baselines out of sample
on the synthetic market, and on a market without signal (shuffled returns) it claims none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import default_pipeline_env

REPO = Path(__file__).resolve().parents[1]


def _quickstart(out: Path, *sets: str) -> dict:
    # As a user runs it: XLA's default pipeline, not the suite's -O0 (conftest.py), under which
    # the quickstart's training runs slower than its compilation gains; the second run here
    # loads the first's programs from the compilation cache.
    env = default_pipeline_env(PYTHONPATH=str(REPO))
    args = [sys.executable, "-m", "jdqn.main", "--config", "configs/quickstart.toml",
            "--output-dir", str(out), "--set", "logging.progress=false"]
    for s in sets:
        args += ["--set", s]
    res = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    (out / "stdout.txt").write_text(res.stdout)
    return json.loads((out / "report.json").read_text())


def _t_stat(returns: np.ndarray) -> float:
    return float(returns.mean() / returns.std(ddof=1) * np.sqrt(len(returns)))


@pytest.mark.slow
def test_quickstart_beats_flat_and_random_out_of_sample(tmp_path):
    out = tmp_path / "qs"
    report = _quickstart(out)
    test, base = report["test"], report["baselines"]
    returns = pd.read_csv(out / "returns.csv")
    # flat earns exactly nothing; the agent must earn more, net of costs, and significantly so.
    assert base["flat"]["total_return"] == 0.0
    assert test["total_return"] > 0.0
    assert test["sharpe"] > base["random"]["sharpe"]
    assert test["total_return"] > base["random"]["total_return"]
    assert _t_stat(returns["strategy_return"].to_numpy()) > 2.0
    # The run folder holds everything the README promises.
    for name in ("config.toml", "metrics.jsonl", "report.json", "returns.csv", "summary.md",
                 "plots/equity.png", "plots/drawdown.png", "plots/position.png",
                 "plots/actions.png"):
        assert (out / name).is_file(), name
    assert any((out / "tensorboard").iterdir())
    assert any(p.name.isdigit() for p in (out / "checkpoints").iterdir())
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 2 and "val" in json.loads(lines[-1])
    assert report["extra"]["epoch_compilations"] == 1
    assert len(report["folds"]) == 2
    # What trained it (the CLI ran under this interpreter and its packages)
    import jax

    assert report["extra"]["device_kind"] == jax.devices()[0].device_kind
    assert report["extra"]["versions"]["jax"] == jax.__version__
    assert report["extra"]["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))


@pytest.mark.slow
def test_no_signal_market_claims_no_edge(tmp_path):
    out = tmp_path / "shuffled"
    _quickstart(out, "data.synthetic.shuffle_returns=true")
    returns = pd.read_csv(out / "returns.csv")["strategy_return"].to_numpy()
    # One-sided: what the control guards against is a claimed edge (lookahead, or an artifact
    # of the simulated fills, such as the certain limit fills of an earlier synthetic market,
    # which made this t-statistic +2.85). Without an edge the agent pays costs, so a negative t
    # is expected and is no claim.
    assert _t_stat(returns) < 2.0
