"""The command line: one-line errors with exit code 2 for bad input, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "jdqn.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def assert_user_error(res: subprocess.CompletedProcess, *fragments: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("jdqn: error: ")
    assert "Traceback" not in res.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def ticks_config(tmp_path: Path, csv_text: str, name: str = "ticks.csv") -> Path:
    data = tmp_path / name
    data.write_text(csv_text)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f"""
[data]
source = "ticks"
path = "{data}"
cache_dir = ""
[data.columns]
timestamp = "ts"
price = "price"
size = "size"
""")
    return cfg


GOOD_TICKS = "ts,price,size\n" + "\n".join(
    f"2024-01-02 {h:02d}:{m:02d}:{s:02d},{4000 + (h * 3 + m * 7 + s) % 5 * 0.25},{1 + s % 3}"
    for h in range(10, 15) for m in range(60) for s in (5, 25, 45)) + "\n"


def test_unknown_config_key_suggests_the_nearest(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nbatch_sise = 64\n")
    assert_user_error(run_cli("--config", str(cfg)), "unknown config key 'train.batch_sise'",
                      "did you mean 'train.batch_size'")


def test_value_out_of_range_names_field_and_range(tmp_path):
    res = run_cli("--config", "configs/quickstart.toml", "--set", "train.gamma=2",
                  "--output-dir", str(tmp_path / "o"))
    assert_user_error(res, "train.gamma = 2", "allowed: [0, 1]")
    assert not (tmp_path / "o").exists()


def test_bad_set_syntax(tmp_path):
    assert_user_error(run_cli("--config", "configs/quickstart.toml", "--set", "train.lr"),
                      "expected KEY=VALUE")


@pytest.mark.parametrize("name", ["exp[lr=1e-3]", "a\\b"])
def test_a_run_folder_orbax_cannot_restore_from_is_refused_before_anything_is_written(
        tmp_path, name):
    """orbax globs for a save's files ('[...]' is a pattern) and tensorstore splits at '\\':
    a run there trained, 'saved' its checkpoints, and could never be resumed. Refused up
    front, for --output-dir and for the default folder a config's file name gives; nothing
    is created."""
    out = tmp_path / name
    assert_user_error(run_cli("--config", "configs/quickstart.toml", "--output-dir", str(out)),
                      "--output-dir", "could never be restored")
    assert not out.exists()
    cfg = tmp_path / "exp[1].toml"
    cfg.write_text((REPO / "configs" / "quickstart.toml").read_text())
    assert_user_error(run_cli("--config", str(cfg), cwd=tmp_path),
                      "the run folder runs/exp[1]", "'[' ']'")
    assert not (tmp_path / "runs").exists()


def test_missing_config_and_data_files(tmp_path):
    assert_user_error(run_cli("--config", str(tmp_path / "none.toml")), "config file not found")
    cfg = ticks_config(tmp_path, GOOD_TICKS)
    cfg.write_text(cfg.read_text().replace(str(tmp_path / "ticks.csv"), str(tmp_path / "gone.csv")))
    assert_user_error(run_cli("--config", str(cfg), "--output-dir", str(tmp_path / "o")),
                      "gone.csv")


@pytest.mark.parametrize("text,fragments", [
    ("ts,price\n2024-01-02 14:00:00,4000\n", ("size",)),  # missing column
    ("ts,price,size\n2024-01-02 14:00:00,4000,1\n2024-01-02 14:00:01,nan,1\n", ("price",)),
    ("ts,price,size\n2024-01-02 14:00:00,4000,1\n2024-01-02 14:00:01,-3,1\n", ("price",)),
    ("ts,price,size\n2024-01-02 14:00:00,4000,1\nyesterday,4000,1\n", ("timestamp",)),
    ("", ("empty",)),
    # a row with a field missing: pyarrow names its text, the error adds row and line
    ("ts,price,size\n2024-01-02 14:00:00,4000,1\n2024-01-02 14:00:01,4000\n",
     ("row 2 (line 3)", "Expected 3 columns, got 2")),
    ("ts,price,size\n2024-01-02 14:00:00,4000,1,7\n", ("row 1 (line 2)", "got 4")),
])
def test_bad_data_is_one_line_naming_file_and_problem(tmp_path, text, fragments):
    cfg = ticks_config(tmp_path, text)
    res = run_cli("--config", str(cfg), "--output-dir", str(tmp_path / "o"))
    assert_user_error(res, "ticks.csv", *fragments)


def test_a_binary_file_read_as_csv_prints_no_raw_bytes(tmp_path):
    cfg = ticks_config(tmp_path, "")
    data = tmp_path / "ticks.csv"
    data.write_bytes(b"ts,price,size\n" + bytes(range(256)) * 4 + b"\n1,2\n")
    res = run_cli("--config", str(cfg), "--features-only")
    assert_user_error(res, "ticks.csv")
    line = res.stderr.strip()
    assert line.isprintable() and len(line) < 400, line


def test_duplicate_ohlcv_timestamps(tmp_path):
    data = tmp_path / "bars.csv"
    data.write_text("timestamp,open,high,low,close,volume\n"
                    "2024-01-02 14:00:00,1,2,0.5,1.5,10\n2024-01-02 14:00:00,1,2,0.5,1.5,10\n")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[data]\nsource = "ohlcv"\npath = "{data}"\ncache_dir = ""\n')
    assert_user_error(run_cli("--config", str(cfg), "--features-only"), "bars.csv", "duplicate")


def test_features_only_prints_a_summary(tmp_path):
    cfg = ticks_config(tmp_path, GOOD_TICKS)
    res = run_cli("--config", str(cfg), "--features-only")
    assert res.returncode == 0, res.stderr
    assert "bars: 300 from ticks" in res.stdout
    assert "flow_imb" in res.stdout
    assert "cache off" in res.stdout  # the config sets data.cache_dir = ""


def test_data_path_a_folder_and_cache_dir_a_file_are_named(tmp_path):
    cfg = ticks_config(tmp_path, GOOD_TICKS)
    folder = tmp_path / "adir"
    folder.mkdir()
    bad = tmp_path / "bad.toml"
    bad.write_text(cfg.read_text().replace(str(tmp_path / "ticks.csv"), str(folder)))
    assert_user_error(run_cli("--config", str(bad), "--features-only"),
                      f"{folder}: is a folder, not a data file")
    blocker = tmp_path / "cachefile"
    blocker.write_text("not a folder")
    res = run_cli("--config", str(cfg), "--features-only", "--set", f"data.cache_dir='{blocker}'")
    assert_user_error(res, f"data.cache_dir = '{blocker}' is a file, not a folder")
    assert blocker.read_text() == "not a folder"


def test_a_bad_set_value_is_attributed_to_the_command_line(tmp_path):
    res = run_cli("--config", "configs/quickstart.toml", "--set", "train.batch_size=-1",
                  "--features-only")
    assert_user_error(res, "jdqn: error: --set: train.batch_size")
    broken = tmp_path / "broken.toml"
    broken.write_text("[train]\nbatch_size = -1\n")
    res = run_cli("--config", str(broken), "--set", "train.lr=1e-3", "--features-only")
    assert_user_error(res, f"jdqn: error: {broken}: train.batch_size")
    # The file is bad too, but the error is about the key the command line set.
    res = run_cli("--config", str(broken), "--set", "train.batch_size=64", "--set", "train.lr=-1",
                  "--features-only")
    assert_user_error(res, "jdqn: error: --set: train.lr = -1")


def test_existing_output_dir_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    res = run_cli("--config", "configs/quickstart.toml", "--output-dir", str(out))
    assert_user_error(res, "already holds files", "--resume")
    assert (out / "precious.txt").read_text() == "keep me"
    assert_user_error(run_cli("--config", "configs/quickstart.toml", "--resume"),
                      "--resume needs --output-dir")


def test_a_dotdot_output_dir_cannot_reach_an_existing_run(tmp_path):
    """`run/missing/..` is `run`: refused like `run` itself, nothing overwritten, nothing made
    (the OS reported the path missing while `missing` was, and the run wrote into `run`)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("# the user's\n")
    res = run_cli("--config", "configs/quickstart.toml", "--output-dir",
                  str(out / "missing" / ".."))
    assert_user_error(res, f"output dir {out} already holds files")
    assert (out / "config.toml").read_text() == "# the user's\n"
    assert sorted(p.name for p in out.iterdir()) == ["config.toml"]


def test_a_run_that_fails_before_starting_leaves_no_run_behind(tmp_path, monkeypatch):
    """Bad data stops the run before anything but config.toml is written: the folder is not
    left holding a run that blocks a corrected retry (or litters runs/)."""
    cfg = ticks_config(tmp_path, GOOD_TICKS)
    good = cfg.read_text()
    cfg.write_text(good.replace(str(tmp_path / "ticks.csv"), str(tmp_path / "gone.csv")))
    out = tmp_path / "o"
    for _ in range(2):  # the retry fails on the data again, not on the folder
        assert_user_error(run_cli("--config", str(cfg), "--output-dir", str(out)), "gone.csv")
        assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()  # an empty folder the user made stays, empty
    assert_user_error(run_cli("--config", str(cfg), "--output-dir", str(kept)), "gone.csv")
    assert kept.is_dir() and not any(kept.iterdir())
    assert_user_error(run_cli("--config", str(cfg), cwd=tmp_path), "gone.csv")
    assert not (tmp_path / "runs").exists()  # runs/cfg/<stamp> was made by it, and removed
    (tmp_path / "runs").mkdir()  # a runs/ folder that was there stays
    assert_user_error(run_cli("--config", str(cfg), cwd=tmp_path), "gone.csv")
    assert (tmp_path / "runs").is_dir() and not any((tmp_path / "runs").iterdir())
    # A nested new --output-dir goes with all the folders the run made; a bad --autotune-file
    # (refused after the folder was made) leaves nothing either.
    assert_user_error(run_cli("--config", str(cfg), "--output-dir", str(tmp_path / "a" / "b")),
                      "gone.csv")
    assert not (tmp_path / "a").exists()
    work = tmp_path / "w"
    work.mkdir()
    res = run_cli("--config", str(REPO / "configs" / "quickstart.toml"), "--autotune-file",
                  str(work / "nodir" / "f"), cwd=work)
    assert_user_error(res, "--autotune-file")
    assert not (work / "runs").exists()
    # A resume never discards: its folder is the user's run.
    (kept / "config.toml").write_text("keep me")
    res = run_cli("--config", str(cfg), "--output-dir", str(kept), "--resume")
    assert res.returncode == 2 and (kept / "config.toml").read_text() == "keep me"


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "run"
    f.write_text("not a folder")
    assert_user_error(run_cli("--config", "configs/quickstart.toml", "--output-dir", str(f)),
                      f"--output-dir {f} is a file")
    assert f.read_text() == "not a folder"


def test_os_error_is_one_line_naming_the_file(tmp_path):
    """An operating-system error (here: the run folder's parent is a file, so it cannot be
    created) is one line naming the path, exit code 1, no traceback."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder is needed")
    res = run_cli("--config", "configs/quickstart.toml", "--output-dir",
                  str(blocker / "run"))
    assert res.returncode == 1, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("jdqn: error: "), res.stderr
    assert str(blocker) in lines[0]
    assert blocker.read_text() == "a file where a folder is needed"


def test_es_ticks_config_builds_features_from_the_shipped_sample():
    res = run_cli("--config", "configs/es_ticks.toml", "--features-only",
                  "--set", "data.cache_dir=''")
    assert res.returncode == 0, res.stderr
    assert "from ticks (builtin:es_ticks)" in res.stdout


def test_episode_longer_than_the_train_window_is_refused(tmp_path):
    res = run_cli("--config", "configs/quickstart.toml", "--set", "env.episode_length=50000",
                  "--output-dir", str(tmp_path / "o"))
    assert_user_error(res, "env.episode_length = 50000", "shortest train window")


def test_prices_off_the_env_tick_grid_are_refused(tmp_path):
    """The sample's ticks are on 0.25: with env.tick_size = 0.1 the costs would be counted in
    the wrong unit; the run is refused, naming the price, the bar and the switches."""
    res = run_cli("--config", str(ticks_config(tmp_path, GOOD_TICKS)), "--set",
                  "env.tick_size=0.1", "--output-dir", str(tmp_path / "o"))
    assert_user_error(res, "off the env.tick_size = 0.1 grid", "env.check_tick_grid = false")
    assert not (tmp_path / "o").exists()


def test_default_output_dir_is_a_new_timestamped_folder(tmp_path, monkeypatch):
    """Created here, each run its own: a run started in the same second as another, or a
    folder already there, gets the next free name (-2, -3, …) and never shares one."""
    import datetime
    import types

    import jdqn.main as cli_main

    now = datetime.datetime(2024, 1, 2, 3, 4, 5)
    monkeypatch.setattr(cli_main, "_dt", types.SimpleNamespace(
        datetime=types.SimpleNamespace(now=lambda: now)))
    monkeypatch.chdir(tmp_path)
    old = Path("runs") / "quickstart" / "20240102-030405"
    old.mkdir(parents=True)
    (old / "config.toml").write_text("keep me")
    outs = [cli_main.resolve_output_dir("configs/quickstart.toml", None, resume=False)
            for _ in range(2)]
    assert outs == [old.with_name("20240102-030405-2"), old.with_name("20240102-030405-3")]
    assert all(o.is_dir() and not any(o.iterdir()) for o in outs)
    assert (old / "config.toml").read_text() == "keep me"


def test_resume_with_a_config_that_is_not_utf8_names_the_file(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_bytes("[data]\nsource = 'synth\u00e9tique'\n".encode("latin-1"))
    res = run_cli("--config", "configs/quickstart.toml", "--output-dir", str(out), "--resume")
    assert_user_error(res, f"{out / 'config.toml'} is not a UTF-8 text file")


def test_empty_autotune_file_is_refused(tmp_path):
    res = run_cli("--config", "configs/quickstart.toml", "--output-dir", str(tmp_path / "o"),
                  "--autotune-file", "")
    assert_user_error(res, "--autotune-file needs a file path")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,fragment", [
    (["--config", "configs/quickstart.toml", "--bogus"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: --config"),
    (["--config", "configs/quickstart.toml", "--set"], "argument --set: expected one argument"),
])
def test_bad_command_line_is_one_line(args, fragment, capsys):
    from jdqn.main import main

    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"jdqn: error: {fragment} (see --help)"]


def test_state_width_too_small_is_refused_before_the_run_folder_is_written(tmp_path):
    res = run_cli("--config", "configs/quickstart.toml", "--set", "features.state_width=8",
                  "--output-dir", str(tmp_path / "o"))
    assert_user_error(res, "features.state_width = 8 is too small", "need 31")
    assert not (tmp_path / "o").exists()


def test_state_width_overflowed_by_the_data_is_a_user_error(tmp_path, monkeypatch, capsys):
    """Order-book levels add features the config alone cannot count: the layout's check then
    fails inside the job, and is reported as the config error it is."""
    import jdqn.main as cli_main
    import jdqn.train.job as job_lib
    from jdqn.data import StateLayout

    def fake_run_job(cfg, out, resume=False):
        StateLayout(n_features=70, width=64)

    monkeypatch.setattr(job_lib, "run_job", fake_run_job)
    monkeypatch.setenv("JDQN_XLA_CACHE", "0")
    assert cli_main.main(["--config", "configs/quickstart.toml",
                          "--output-dir", str(tmp_path / "o")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [("jdqn: error: features.state_width = 64 is too small: 70 features + 7 "
                    "portfolio slots need 77; raise state_width or use fewer features")]


def test_autotune_file_records_first_then_loads(tmp_path):
    from jdqn.config import ConfigError
    from jdqn.main import autotune_xla_flags

    f = tmp_path / "at.textproto"
    mode, flags = autotune_xla_flags(str(f), "--xla_foo=1")
    assert mode == "dump" and flags == f"--xla_foo=1 --xla_gpu_dump_autotune_results_to={f}"
    f.write_text("results {}")
    mode, flags = autotune_xla_flags(str(f), "")
    assert mode == "load" and flags == (f"--xla_gpu_load_autotune_results_from={f} "
                                        "--xla_gpu_require_complete_aot_autotune_results=true")
    bad = [(str(tmp_path), "", "is a folder"),
           (str(tmp_path / "nope" / "at.pb"), "", "does not exist"),
           (str(tmp_path / "a b.pb"), "", "with spaces"),
           (str(f), "--xla_gpu_load_autotune_results_from=/x", "XLA_FLAGS already sets")]
    for path, env, fragment in bad:
        with pytest.raises(ConfigError, match=fragment):
            autotune_xla_flags(path, env)
    empty = tmp_path / "empty.pb"
    empty.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        autotune_xla_flags(str(empty), "")
    # Through the CLI: a one-line error, and nothing run.
    res = run_cli("--config", "configs/quickstart.toml", "--output-dir", str(tmp_path / "run"),
                  "--autotune-file", str(tmp_path))
    assert_user_error(res, "--autotune-file", "is a folder")
    assert not (tmp_path / "run").exists()


def test_autotune_file_in_process_errors_and_env_restored(tmp_path, monkeypatch, capsys):
    import jax.numpy as jnp

    import jdqn.main as cli_main
    import jdqn.train.job as job_lib

    # JAX runs first (XLA parses XLA_FLAGS once, at its start; an unknown flag there aborts).
    float(jnp.ones(2).sum())
    monkeypatch.setenv("JDQN_XLA_CACHE", "0")
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    f = tmp_path / "at.textproto"
    f.write_text("results {}")
    args = ["--config", "configs/quickstart.toml", "--autotune-file", str(f)]
    # JAX already ran in this process: XLA would ignore the flags, so the run is refused.
    assert cli_main.main([*args, "--output-dir", str(tmp_path / "a")]) == 2
    assert "JAX has already started" in capsys.readouterr().err
    # XLA refusing the file (here faked) is a one-line error naming it; the flags it ran under
    # demand complete results, and XLA_FLAGS is restored afterwards.
    seen = {}

    def fake_run_job(cfg, out, resume=False):
        seen["flags"] = os.environ["XLA_FLAGS"]
        raise RuntimeError("INTERNAL: Autotuning results for fusion.3 are missing\nmore")

    monkeypatch.setattr(cli_main, "_jax_backend_started", lambda: False)
    monkeypatch.setattr(job_lib, "run_job", fake_run_job)
    assert cli_main.main([*args, "--output-dir", str(tmp_path / "b")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and f"--autotune-file {f}: XLA could not compile with it" in err[0]
    assert "--xla_gpu_require_complete_aot_autotune_results=true" in seen["flags"]
    assert f"--xla_gpu_load_autotune_results_from={f}" in seen["flags"]
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1"


def test_resume_config_diff_names_a_setting_the_saved_config_lacks():
    """A run written by a version without a setting: the saved config resolves to the current
    defaults, but the difference is still named (it said "formatting only")."""
    from jdqn.config import Config, dumps_toml
    from jdqn.main import _config_diff

    now = dumps_toml(Config())
    lines = now.splitlines(keepends=True)
    saved = "".join(ln for ln in lines if not ln.startswith("per_priority"))
    assert saved != now
    assert _config_diff(saved, now) == "train.per_priority: '<unset>' → 'kl'"
    older = now.replace("[train]\n", "[train]\nold_knob = 3\n", 1)
    assert _config_diff(older, now) == "train.old_knob: 3 → '<unset>'"
    assert _config_diff(now, now) == "formatting only"


def test_out_of_device_memory_is_one_line_and_leaves_no_run_behind(tmp_path, monkeypatch,
                                                                   capsys):
    """A size in range that the device cannot hold (replay_capacity = 2³⁰: 30 GB) fails while
    the training state is allocated, after the logs were opened: one line naming the settings,
    exit 1, and the folder holds nothing a retry would have to --resume."""
    import jax

    import jdqn.main as cli_main
    import jdqn.train.job as job_lib

    def fake_run_job(cfg, out, resume=False):
        (out / "metrics.jsonl").touch()
        (out / "checkpoints").mkdir()
        (out / "tensorboard").mkdir()
        (out / "tensorboard" / "events.out.tfevents.0").write_bytes(b"header")
        raise jax.errors.JaxRuntimeError(  # the GPU allocator's wording
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 30064771072 bytes.")

    monkeypatch.setattr(job_lib, "run_job", fake_run_job)
    monkeypatch.setenv("JDQN_XLA_CACHE", "0")
    out = tmp_path / "o"
    assert cli_main.main(["--config", "configs/quickstart.toml", "--output-dir", str(out)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("jdqn: error: out of device memory (28.0 GiB")
    assert "train.replay_capacity" in err[0]
    assert not out.exists()
    assert "(28.0 GiB" in cli_main._out_of_memory(RuntimeError(  # the CPU's wording
        "RESOURCE_EXHAUSTED: Out of memory allocating 30064771072 bytes."))
    assert cli_main._out_of_memory(RuntimeError(  # a kernel tile, not the device's memory
        "RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 262144")) is None

    def logged_run_job(cfg, out, resume=False):  # an epoch logged: the run is kept
        (out / "metrics.jsonl").write_text('{"epoch": 0}\n')
        raise RuntimeError("something else")

    monkeypatch.setattr(job_lib, "run_job", logged_run_job)
    with pytest.raises(RuntimeError, match="something else"):
        cli_main.main(["--config", "configs/quickstart.toml", "--output-dir", str(out)])
    assert (out / "metrics.jsonl").read_text() == '{"epoch": 0}\n'

    # no metrics.jsonl, no checkpoints: the epochs went to TensorBoard alone — still a run
    from jdqn.config import LoggingConfig
    from jdqn.train.logger import RunLogger

    def tensorboard_only_run_job(cfg, out, resume=False):
        log = RunLogger(out, LoggingConfig(progress=False, jsonl=False, tensorboard=True),
                        total_epochs=2, quiet=True)
        log.log_epoch({"fold": 0, "epoch": 0, "loss": {"total": 1.0}}, 1)
        log.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(job_lib, "run_job", tensorboard_only_run_job)
    kept = tmp_path / "tb_only"
    assert cli_main.main(["--config", "configs/quickstart.toml", "--output-dir",
                          str(kept)]) == 130
    assert any((kept / "tensorboard").iterdir())
