"""Command line: ``python -m jdqn.main --config PATH [--set k=v ...] [--output-dir DIR] [--resume]
[--autotune-file PATH]``.

Runs the whole job: data → features → walk-forward training → test-window backtest → report.
``--features-only`` stops after building (or loading) the features and prints what it built.

User errors (bad config, bad data, unusable checkpoint, a safety halt) print one line
``jdqn: error: …`` and exit with code 2; an operating-system error (permissions, a full disk)
prints one such line naming the file and exits with code 1. Nothing is written over an existing
run unless ``--resume`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import os
import shutil
import sys
import tomllib
import typing
from collections.abc import Iterator
from pathlib import Path

from jdqn.config import (
    Config,
    ConfigError,
    checkpoint_path_problem,
    config_from_dict,
    dumps_toml,
    load_config,
)
from jdqn.errors import JdqnError

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, missing --config) are our one-line user error."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m jdqn.main",
        description="Train and evaluate a branching distributional DQN on futures bars.",
    )
    p.add_argument("--config", required=True, help="TOML config file (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=1e-3 (repeatable)")
    p.add_argument("--output-dir", default=None,
                   help="run folder (default: runs/<config name>/<timestamp>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir from its latest checkpoint")
    p.add_argument("--autotune-file", default=None, metavar="PATH",
                   help="GPU reproducibility at full speed: the first run records XLA's "
                   "autotuned kernel choices in PATH, later runs given the same PATH compile "
                   "the same kernels, so their results are bitwise identical "
                   "(docs/training.md, 'Determinism')")
    p.add_argument("--features-only", action="store_true",
                   help="build (or load from cache) the bars and features, print a summary, stop")
    g = p.add_argument_group("multi-host (parallel.distributed = true; docs/training.md, "
                             "'Multi-host')")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordination service (omit all three flags "
                   "to let JAX detect the cluster: SLURM, Open MPI, ...)")
    g.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="how many processes the job has (one per host)")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process's index, 0 … N−1; process 0 writes the run folder")
    return p


def default_runs_dir(cfg_path: str) -> Path:
    """``runs/<config name>``: where a run goes without ``--output-dir`` (a timestamped folder
    inside it)."""
    return Path("runs") / Path(cfg_path).stem


def resolve_output_dir(cfg_path: str, output_dir: str | None, resume: bool) -> Path:
    """Pick the run folder and refuse to overwrite an existing run without ``--resume``.

    The default folder, ``runs/<config name>/<timestamp>[-N]``, is created here, and only if it
    did not exist: two runs started in the same second get a folder each."""
    where = default_runs_dir(cfg_path) if output_dir is None else Path(output_dir)
    problem = checkpoint_path_problem(where)
    if problem:  # refused before anything is written
        what = f"--output-dir {output_dir}" if output_dir is not None else \
            f"the run folder {where} (from the config file's name)"
        raise ConfigError(f"{what}: {problem}; choose a path without them")
    if output_dir is None:
        if resume:
            raise ConfigError("--resume needs --output-dir naming the run to continue")
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        for n in itertools.count(1):
            out = default_runs_dir(cfg_path) / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                out.mkdir(parents=True)
                return out
            except FileExistsError:
                continue
    # `..` taken lexically, as the checks below and every later write see it: `run/x/..` is
    # `run`, whose files are then refused here (the OS reads it as "not found" while x is
    # missing, and mkdir(parents=True) would create x and write into `run`)
    out = Path(os.path.normpath(output_dir))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} is a file, not a folder")
    if resume:
        if not (out / "config.toml").is_file():
            raise ConfigError(f"--resume: {out} holds no run (no config.toml there)")
    elif out.exists() and any(out.iterdir()):
        raise ConfigError(f"output dir {out} already holds files; pass --resume to continue that "
                          "run or choose another --output-dir")
    return out


def _config_diff(saved: str, now: str, limit: int = 5) -> str:
    """``section.key: saved → now`` for the first ``limit`` settings that differ."""

    def flat(table: dict, prefix: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in table.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    try:
        saved_table = tomllib.loads(saved)
    except tomllib.TOMLDecodeError:
        return "the saved config.toml is not valid TOML"
    try:  # compare resolved configs (defaults filled in), so only real differences show
        resolved = tomllib.loads(dumps_toml(config_from_dict(saved_table)))
    except ConfigError:  # an older or invalid saved config: compare it as written
        resolved = saved_table
    a, b, written = flat(resolved), flat(tomllib.loads(now)), flat(saved_table)
    # a setting the saved file lacks or has that this version does not (a run written by
    # another version of jdqn) differs even where the default fills it with the same value
    for k in b.keys() - written.keys():
        a[k] = "<unset>"
    keys = [k for k in sorted(a.keys() | b.keys() | written.keys())
            if a.get(k, written.get(k, "<unset>")) != b.get(k, "<unset>")]
    parts = [f"{k}: {a.get(k, written.get(k, '<unset>'))!r} → {b.get(k, '<unset>')!r}"
             for k in keys[:limit]]
    more = f", and {len(keys) - limit} more" if len(keys) > limit else ""
    return "; ".join(parts) + more if parts else "formatting only"


def write_resolved_config(cfg: Config, out: Path, resume: bool) -> None:
    """Write ``config.toml``; on resume, refuse a config that differs from the saved one."""
    text = dumps_toml(cfg)
    path = out / "config.toml"
    if resume:
        try:
            saved = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"--resume: {path} is not a UTF-8 text file (byte {e.start}); it "
                              "is not a config this program wrote") from None
        if saved != text:
            raise ConfigError(f"--resume: the config differs from the one saved in {path} "
                              f"({_config_diff(saved, text)}); resume with the same config and "
                              "--set overrides")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def features_summary(cfg: Config) -> str:
    from jdqn.data import load_or_build

    bars, feats, hit = load_or_build(cfg)
    lines = [
        f"bars: {len(bars.close)} from {cfg.data.source}"
        + (f" ({cfg.data.path})" if cfg.data.path else ""),
        (f"features: {feats.values.shape[1]} columns, warm-up {feats.warmup} bars, "
         f"cache {'off' if not cfg.data.cache_dir else 'hit' if hit else 'built'}"),
        "  " + ", ".join(feats.names),
    ]
    return "\n".join(lines)


_AUTOTUNE_FLAGS = ("--xla_gpu_load_autotune_results_from", "--xla_gpu_dump_autotune_results_to")
_REQUIRE_COMPLETE = "--xla_gpu_require_complete_aot_autotune_results=true"


def autotune_xla_flags(path: str, xla_flags: str) -> tuple[str, str]:
    """``(mode, XLA_FLAGS)`` for ``--autotune-file PATH``: ``"load"`` when PATH holds recorded
    results (XLA then compiles with those kernel choices instead of timing candidates, and a
    program the file does not cover is a compile error rather than a silently re-autotuned
    kernel), else ``"dump"`` (XLA records its choices there as it compiles). A name ending in
    ``.txt`` or ``.textproto`` is written as text, anything else in binary. Must take effect
    before JAX starts its backend."""
    for flag in _AUTOTUNE_FLAGS:
        if flag in xla_flags:
            raise ConfigError(f"--autotune-file {path}: XLA_FLAGS already sets {flag}; "
                              "give one or the other")
    if any(c.isspace() for c in path):
        raise ConfigError(f"--autotune-file {path!r}: XLA_FLAGS cannot carry a path with spaces")
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--autotune-file {path} is a folder, not a file")
    if p.is_file():
        if p.stat().st_size == 0:
            raise ConfigError(f"--autotune-file {path} is empty (no GPU autotuning was recorded "
                              "in it); delete it to record a new one")
        mode, flag = "load", f"{_AUTOTUNE_FLAGS[0]}={p.resolve()} {_REQUIRE_COMPLETE}"
    else:
        if not p.parent.is_dir():
            raise ConfigError(f"--autotune-file {path}: folder {p.parent} does not exist")
        mode, flag = "dump", f"{_AUTOTUNE_FLAGS[1]}={p.resolve()}"
    return mode, f"{xla_flags} {flag}".strip()


def _jax_backend_started() -> bool:
    """Whether this process has started a JAX backend already (XLA then ignores new flags)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # private API moved: assume not started
        return False


def _file_digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def enable_compilation_cache(subdir: str = "") -> None:
    """Keep compiled XLA programs on disk so a second run skips compilation.

    ``$JAX_COMPILATION_CACHE_DIR`` wins; else ``$XDG_CACHE_HOME/jdqn/xla`` (``~/.cache``);
    ``JDQN_XLA_CACHE=0`` turns it off. Cached programs are the same programs: results do not
    change. ``subdir`` keeps programs compiled under different inputs apart (JAX's cache key
    holds the XLA flags but not the contents of an autotune file they name).
    """
    if os.environ.get("JDQN_XLA_CACHE", "1") == "0":
        return
    import jax

    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jdqn" / "xla")
    jax.config.update("jax_compilation_cache_dir", str(Path(path) / subdir) if subdir else path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.autotune_file == "":
            raise ConfigError("--autotune-file needs a file path")
        cfg = load_config(args.config, args.overrides)
        if args.features_only:
            print(features_summary(cfg))
            return 0
        multi = cfg.parallel.distributed
        flags = [args.coordinator, args.num_processes, args.process_id]
        if not multi and any(f is not None for f in flags):
            raise ConfigError("--coordinator/--num-processes/--process-id need "
                              "parallel.distributed = true in the config")
        if multi and args.output_dir is None:
            raise ConfigError("parallel.distributed = true needs --output-dir: every process "
                              "must name the same run folder (on a shared file system)")
        if multi and args.autotune_file is not None:
            raise ConfigError("--autotune-file is not available with parallel.distributed = "
                              "true (every process would record its own kernel choices into "
                              "the one file); use XLA_FLAGS=--xla_gpu_deterministic_ops=true "
                              "for bitwise reproducible multi-host runs")
        if args.output_dir is not None:  # `run/x/..` is `run` for every check and write
            args.output_dir = os.path.normpath(args.output_dir)
        target = (Path(args.output_dir) if args.output_dir is not None
                  else default_runs_dir(args.config))
        existed = {d for d in (target, *target.parents) if d.exists()}  # before this run
        out = None if multi else resolve_output_dir(args.config, args.output_dir, args.resume)
        fresh = out if not (multi or args.resume) else None  # this invocation's new run
        with _discard_if_unstarted(fresh, existed), _autotune(args.autotune_file) as autotune:
            if multi:
                from jdqn.train import distributed

                distributed.initialize(*flags)
                out = _primary_prepares_the_folder(cfg, args)
            else:
                write_resolved_config(cfg, out, args.resume)
            if autotune is None:
                enable_compilation_cache()
            elif autotune == "dump":  # every program must compile (and autotune) to be recorded
                import jax

                jax.config.update("jax_enable_compilation_cache", False)
            else:
                enable_compilation_cache(f"autotune-{_file_digest(Path(args.autotune_file))}")
            from jdqn.train.job import run_job

            run_job(cfg, out, resume=args.resume)
        if not multi or distributed.is_primary():
            print(f"run written to {out}")
        if autotune == "dump":
            f = Path(args.autotune_file)
            print(f"XLA's autotuned kernel choices recorded in {f}; pass --autotune-file {f} "
                  "to later runs of this config" if f.is_file() and f.stat().st_size else
                  f"nothing recorded in {f}: no GPU autotuning ran (CPU backend)")
        return 0
    except JdqnError as e:
        print(f"jdqn: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as e:  # permissions, a full disk, a vanished folder: say which file
        where = f" ({e.filename})" if e.filename else ""
        print(f"jdqn: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("jdqn: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        oom = _out_of_memory(e)
        if oom is None:
            raise
        print(f"jdqn: error: {oom}", file=sys.stderr)
        return 1


def _out_of_memory(e: BaseException) -> str | None:
    """One line for XLA's out-of-memory error (a size in range that the device cannot hold),
    naming the settings that set the large buffers; None for any other error."""
    text = str(e)
    if "out of memory" not in text.lower() or "shared memory" in text.lower():
        return None  # (a kernel's shared-memory limit is RESOURCE_EXHAUSTED too: not this)
    import re

    size = re.search(r"allocat\w* (\d+) bytes", text)  # CPU "allocating", GPU "to allocate"
    what = f" ({int(size.group(1)) / 2**30:.1f} GiB in one buffer)" if size else ""
    return (f"out of device memory{what}: the replay (train.replay_capacity × about 92 bytes "
            "per transition, per seed), the envs (env.n_envs) and the batch "
            "(train.batch_size) set the largest buffers; lower them, or run fewer "
            "train.seeds at once")

@contextlib.contextmanager
def _discard_if_unstarted(out: Path | None, existed: set[Path]):
    """A new run that fails before it has written anything but its ``config.toml`` (bad data,
    a config error found while preparing, a bad ``--autotune-file``, Ctrl-C while building
    features) leaves no run behind: the ``config.toml`` goes, and so do the folders this
    invocation created (``existed`` holds those there before it: they stay, emptied of nothing
    but our file). The folder can then be used again without ``--resume``, and failed attempts
    leave no empty ``runs/<config>/<stamp>`` folders (:func:`_unstarted`: opened logs with no
    epoch in them count as nothing). A run that got further (a logged epoch, a checkpoint)
    keeps everything."""
    from jdqn.train.logger import EPOCHS_LOGGED

    logged = EPOCHS_LOGGED[0]
    try:
        yield
    except BaseException:
        if (out is not None and out.is_dir() and EPOCHS_LOGGED[0] == logged
                and _unstarted(out)):
            for p in out.iterdir():  # a fresh folder: everything in it is this run's
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            for d in (out, *out.parents):
                if d in existed or d == Path(".") or any(d.iterdir()):
                    break
                d.rmdir()
        raise


def _unstarted(out: Path) -> bool:
    """Whether a fresh run folder holds no result, by its files: no epoch in ``metrics.jsonl``
    and no checkpoint, only what opening the run made (``config.toml``, the empty log,
    checkpoint and TensorBoard folders). The caller also requires that this process logged no
    epoch (TensorBoard's files alone do not say: with ``logging.jsonl = false`` and no
    checkpoints a trained run's record is only there). A failure before the first epoch (out
    of device memory while the training state is allocated, a Ctrl-C during compilation)
    leaves nothing a retry would have to ``--resume``."""
    known = {"config.toml", "metrics.jsonl", "checkpoints", "tensorboard"}
    if not {p.name for p in out.iterdir()} <= known:
        return False
    log = out / "metrics.jsonl"
    if log.exists() and log.stat().st_size:
        return False
    ckpt = out / "checkpoints"
    return not (ckpt.is_dir() and any(ckpt.iterdir()))


def _primary_prepares_the_folder(cfg: Config, args: argparse.Namespace) -> Path:
    """Multi-host: every process must have been started alike (config, ``--resume``,
    ``--output-dir``); process 0 alone checks the run folder and writes ``config.toml`` (the
    others would race it), and its verdict reaches every process, so all of them stop on the
    same one-line error or all go on."""
    import hashlib

    from jdqn.train import distributed

    distributed.same_everywhere({
        "config": hashlib.sha256(dumps_toml(cfg).encode()).hexdigest()[:16],
        "--resume": bool(args.resume), "--output-dir": str(args.output_dir)})
    with distributed.together("checking the run folder"):
        if distributed.is_primary():
            out = resolve_output_dir(args.config, args.output_dir, args.resume)
            write_resolved_config(cfg, out, args.resume)
    return Path(args.output_dir)


@contextlib.contextmanager
def _autotune(path: str | None) -> Iterator[str | None]:
    """``--autotune-file``: set XLA_FLAGS for the job (see :func:`autotune_xla_flags`), yield
    the mode (None without the option), turn XLA refusing the file into a one-line error, and
    restore XLA_FLAGS afterwards."""
    if path is None:
        yield None
        return
    if _jax_backend_started():
        raise ConfigError(f"--autotune-file {path}: JAX has already started in this process "
                          "and XLA reads its flags once; give it on the command line")
    before = os.environ.get("XLA_FLAGS")
    mode, os.environ["XLA_FLAGS"] = autotune_xla_flags(path, before or "")
    try:
        yield mode
    except JdqnError:
        raise
    except Exception as e:  # XLA refusing the file (incomplete, foreign, corrupt)
        if "autotun" not in str(e).lower():
            raise
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--autotune-file {path}: XLA could not compile with it ({first}). A file holds the "
            "kernel choices of one config on one GPU model and XLA version, recorded by a run "
            "that compiled every program; delete it to record a new one") from e
    finally:
        if before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = before


def cli() -> None:
    code = main()
    if code == EXIT_USER_ERROR:
        # Everything of ours is closed by now (checkpointer, logs). A failed orbax restore can
        # leave tensorstore callbacks aimed at a closed event loop that would print tracebacks
        # during interpreter teardown, burying the one-line error: skip that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        if "jdqn.train.distributed" in sys.modules:  # multi-host: leave the job first
            sys.modules["jdqn.train.distributed"].shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cli()
