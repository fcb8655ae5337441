"""Run logger: metrics.jsonl records and what a resumed run does with records logged after the
checkpoint it restarts from."""

from __future__ import annotations

import json

import pytest

from jdqn.config import LoggingConfig
from jdqn.train import logger as logger_lib
from jdqn.train.logger import RunLogger, truncate_jsonl


def _records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_truncate_keeps_records_up_to_the_epoch_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"fold": 0, "epoch": e, "global_epoch": e + 1}) for e in range(4)]
    path.write_text("\n".join(lines) + "\n" + '{"fold": 0, "ep')  # killed mid-write
    truncate_jsonl(path, 2)
    assert [r["global_epoch"] for r in _records(path)] == [1, 2]
    truncate_jsonl(path, 5)  # nothing after the checkpoint: unchanged
    assert [r["global_epoch"] for r in _records(path)] == [1, 2]


def test_truncate_refuses_a_damaged_line_before_the_last_and_changes_nothing(tmp_path):
    from jdqn.errors import LogError

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"global_epoch": e}).encode() for e in (1, 2, 3)]
    for bad in (b"[1, 2]", b"\xff\xfe not utf-8", b"{torn"):
        data = b"\n".join([good[0], bad, good[1], good[2]]) + b"\n"
        path.write_bytes(data)
        with pytest.raises(LogError, match="line 2 is not a JSON record"):
            truncate_jsonl(path, 2)
        assert path.read_bytes() == data  # nothing dropped
    # The same damage on the last line is a torn write of a killed run: dropped.
    path.write_bytes(b"\n".join([good[0], good[1], b"\xff{"]))
    truncate_jsonl(path, 5)
    assert path.read_bytes() == b"\n".join(good[:2]) + b"\n"


def test_truncate_counts_lines_for_records_without_a_global_epoch(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"epoch": e}) + "\n" for e in range(5)))
    truncate_jsonl(path, 3)
    assert [r["epoch"] for r in _records(path)] == [0, 1, 2]
    truncate_jsonl(tmp_path / "absent.jsonl", 1)  # no file: nothing to do, no error
    assert not (tmp_path / "absent.jsonl").exists()


def test_resumed_logger_logs_each_epoch_once_and_purges_tensorboard(tmp_path, monkeypatch):
    import tensorboardX

    purges = []
    real = tensorboardX.SummaryWriter

    def spy(*args, **kwargs):
        purges.append(kwargs.get("purge_step"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tensorboardX, "SummaryWriter", spy)
    cfg = LoggingConfig(progress=False)
    first = RunLogger(tmp_path, cfg, total_epochs=4, quiet=True)
    for g in (1, 2, 3):  # epoch 3 logged, but the run dies before its checkpoint commits
        first.log_epoch({"fold": 0, "epoch": g - 1, "loss": {"total": float(g)}}, g)
    first.close()

    resumed = RunLogger(tmp_path, cfg, total_epochs=4, quiet=True, resume_epoch=2)
    for g in (3, 4):
        resumed.log_epoch({"fold": 0, "epoch": g - 1, "loss": {"total": float(g)}}, g)
    resumed.close()
    recs = _records(tmp_path / "metrics.jsonl")
    assert [r["global_epoch"] for r in recs] == [1, 2, 3, 4]
    assert [r["epoch"] for r in recs] == [0, 1, 2, 3]
    assert purges == [None, 3]  # TensorBoard hides the dead run's events from step 3 on


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values_are_written_as_null(tmp_path, value):
    log = RunLogger(tmp_path, LoggingConfig(progress=False, tensorboard=False), 1, quiet=True)
    log.log_epoch({"fold": 0, "epoch": 0, "loss": {"total": value}}, 1)
    log.close()
    assert _records(tmp_path / "metrics.jsonl")[0]["loss"]["total"] is None
    assert logger_lib._json_safe([value]) == [None]


def test_validation_means_leave_out_a_seed_without_a_sharpe():
    """A seed that held no position in validation has no Sharpe (NaN): the epoch's mean
    validation Sharpe, which metrics.jsonl logs and the checkpoints' best-N ranks by, is the
    other seeds' mean, not NaN (NaN ranked every checkpoint lowest); NaN only when no seed has
    one. Each seed's own value stays beside it."""
    import math

    from jdqn.train.job import val_summary

    val = [{"sharpe": 1.5, "total_return": 0.02, "n_trades": 10.0},
           {"sharpe": float("nan"), "total_return": 0.0, "n_trades": 0.0},
           {"sharpe": 0.5, "total_return": 0.01, "n_trades": 6.0}]
    out = val_summary(val, (4, 5, 6))
    assert out["sharpe"] == 1.0
    assert out["total_return"] == pytest.approx(0.01) and out["n_trades"] == pytest.approx(16 / 3)
    assert out["sharpe_per_seed"]["4"] == 1.5 and math.isnan(out["sharpe_per_seed"]["5"])
    flat = [dict(v, sharpe=float("nan")) for v in val]
    assert math.isnan(val_summary(flat, (4, 5, 6))["sharpe"])
    assert logger_lib._json_safe(val_summary(flat, (4, 5, 6)))["sharpe"] is None


def test_a_real_epoch_record_carries_every_documented_diagnostic(tmp_path):
    """One epoch of a tiny job: the metrics.jsonl record has every diagnostic docs/training.md
    lists, per branch where it says per branch, with values that are finite and consistent."""
    import math

    from helpers import tiny_config

    from jdqn.train import job as job_lib

    cfg = tiny_config("train.n_folds=1", "train.epochs_per_fold=1", "logging.tensorboard=false")
    job_lib.run_job(cfg, tmp_path, quiet=True)
    (rec,) = _records(tmp_path / "metrics.jsonl")
    n_branches, sizes = 4, cfg.model.branch_sizes
    assert (rec["fold"], rec["epoch"], rec["global_epoch"]) == (0, 0, 1)
    assert set(rec["loss"]) == {"total", "td", "c51", "mse", "iqn", "moe"}
    for key in ("mean", "std", "mean_per_branch", "std_per_branch"):
        assert len(rec["q"][key]) == n_branches
    assert rec["q"]["gap"] >= 0 and rec["q"]["collect_abs_mean"] >= 0
    assert rec["q"]["collect_abs_ema"] > 0 and math.isfinite(rec["q"]["collect_abs_ema"])
    assert 0 <= rec["atoms"]["edge_mass"] <= 1
    assert rec["atoms"]["effective"] >= 1 and rec["atoms"]["effective"] <= cfg.model.n_atoms
    assert len(rec["atoms"]["target_mean_per_branch"]) == n_branches
    util = rec["moe"]["utilisation"]
    assert len(util) == cfg.model.n_experts and math.isclose(sum(util), 1.0, rel_tol=1e-5)
    assert 0 <= rec["moe"]["entropy"] <= math.log(cfg.model.n_experts) + 1e-6
    # the entropy of the batch's mean gate (what drives λ_eff) is at least the mean per-sample
    # gate entropy (concavity), and at most log K
    ent_u = rec["moe"]["util_entropy"]
    assert rec["moe"]["entropy"] - 1e-5 <= ent_u <= math.log(cfg.model.n_experts) + 1e-6
    assert rec["moe"]["lambda_eff"] >= cfg.train.moe_lambda_floor * (1 - 1e-5)  # float32 mean
    assert set(rec["size"]["factors"]) >= {"conviction", "cvar", "kelly", "variance"}
    assert rec["size"]["abs_realised"] <= rec["size"]["abs_intended"] + 1e-9
    for name, a in zip(("direction", "magnitude", "order_type", "urgency"), sizes, strict=True):
        freq = rec["actions"][name]
        assert len(freq) == a and math.isclose(sum(freq), 1.0, rel_tol=1e-5)
    assert set(rec["reward"]) == {"raw", "normalised"}
    assert rec["optim"]["updates"] > 0 and rec["optim"]["grad_norm"] > 0
    assert cfg.train.per_beta0 <= rec["optim"]["per_beta"] <= 1
    assert 0 <= rec["optim"]["blend_alpha"] <= 1
    assert rec["replay_size"] >= cfg.train.min_replay
    assert set(rec["val"]) == {"sharpe", "total_return", "sharpe_per_seed", "n_trades"}
    assert list(rec["val"]["sharpe_per_seed"]) == [str(s) for s in cfg.train.seeds]

    def finite(x):
        if isinstance(x, dict):
            return all(finite(v) for v in x.values())
        if isinstance(x, list):
            return all(finite(v) for v in x)
        return x is not None and math.isfinite(x)

    assert finite(rec), rec


def test_a_resumed_runs_progress_bar_starts_where_the_killed_run_stood():
    """The bar counts plan_epochs = folds × epochs_per_fold; a fold that stops early advances
    it past its skipped epochs. The loop states a run checkpoints (3 folds of 4 epochs; fold 0
    stops early after epoch 1, fold 1 runs in full, fold 2 stops after epoch 2), each with the
    bar's position when that checkpoint is written; a resume from it must start there."""
    from jdqn.train.job import epochs_done

    def state(fold, epoch, done, global_epoch):
        return {"fold": fold, "epoch": epoch, "fold_done": done, "global_epoch": global_epoch}

    checkpoints = [
        (state(0, 0, False, 1), 1),
        (state(0, 1, True, 2), 4),  # early stop: epochs 2 and 3 skipped, the bar jumps
        (state(1, 0, False, 3), 5),
        (state(1, 3, True, 6), 8),
        (state(2, 1, False, 8), 10),
        (state(2, 2, True, 9), 12),  # the bar ends full
    ]
    assert epochs_done(state(0, -1, False, 0), 4) == 0  # a fresh run
    for progress, bar in checkpoints:
        assert epochs_done(progress, 4) == bar, progress
    # global_epoch (what the bar was advanced by before) falls behind after an early stop
    assert [p["global_epoch"] for p, _ in checkpoints] != [b for _, b in checkpoints]

