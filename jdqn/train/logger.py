"""Per-epoch diagnostics: console (rich progress bar + compact line), ``metrics.jsonl``, TensorBoard.

Everything here is host-side and runs once per epoch, after the epoch's metrics were read from
the device in one transfer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jdqn.config import LoggingConfig
from jdqn.errors import LogError


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                if isinstance(x, (int, float)):
                    out[f"{key}/{i}"] = float(x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def truncate_jsonl(path: Path, last_epoch: int) -> None:
    """Keep the records of ``path`` up to global epoch ``last_epoch`` (records without a
    ``global_epoch`` count by line), dropping later ones and a torn last line. Atomic rewrite.
    Any other line that is not a JSON object is a damaged log: refused, naming the line, and
    the file is left as it is."""
    if not path.exists():
        return
    lines = path.read_bytes().split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()
    kept = []
    for i, raw in enumerate(lines):
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            rec = None
        if not isinstance(rec, dict):
            if i == len(lines) - 1:
                break  # a line cut short by the kill: nothing after it was written either
            raise LogError(f"{path}: line {i + 1} is not a JSON record; the log is damaged "
                           "(fix or remove that line to resume)")
        if int(rec.get("global_epoch", i + 1)) > last_epoch:
            break
        kept.append(raw.decode("utf-8") + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


# Epochs logged by this process, whatever the sinks (the CLI tells a run that got as far as an
# epoch from one that failed before: jdqn.main._discard_if_unstarted)
EPOCHS_LOGGED = [0]


class RunLogger:
    """Writes one record per epoch to every enabled sink."""

    def __init__(self, out_dir: Path, cfg: LoggingConfig, total_epochs: int, quiet: bool = False,
                 resume_epoch: int | None = None):
        """``resume_epoch``: the global epoch of the checkpoint a resumed run restarts from.
        A killed run may have logged epochs after its last committed checkpoint; those
        records are dropped from ``metrics.jsonl`` (and purged from TensorBoard) before the
        resumed run logs them again, so every epoch appears once."""
        self.out_dir = Path(out_dir)
        self.cfg = cfg
        if resume_epoch is not None and cfg.jsonl:
            truncate_jsonl(self.out_dir / "metrics.jsonl", resume_epoch)
        # Held open for the run (one line per epoch), closed by close().
        self._jsonl = (open(self.out_dir / "metrics.jsonl", "a")  # noqa: SIM115
                       if cfg.jsonl else None)
        self._tb = None
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if resume_epoch is None else resume_epoch + 1
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=purge)
        self._progress = None
        self._task = None
        if cfg.progress and not quiet:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total} epochs"),
                                      TimeElapsedColumn(), transient=False)
            self._progress.start()
            self._task = self._progress.add_task("training", total=total_epochs)
        self.quiet = quiet

    def log_epoch(self, record: dict[str, Any], global_epoch: int) -> None:
        EPOCHS_LOGGED[0] += 1
        record = _json_safe({**record, "global_epoch": global_epoch})
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in _flatten(record).items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, global_epoch)
            self._tb.flush()
        line = self.format_line(record)
        if self._progress is not None:
            self._progress.console.print(line)
            self._progress.advance(self._task)
        elif not self.quiet:
            print(line, flush=True)

    def advance(self, n: int) -> None:
        """Count epochs skipped by early stopping so the bar ends full."""
        if self._progress is not None and n > 0:
            self._progress.advance(self._task, n)

    @staticmethod
    def format_line(r: dict[str, Any]) -> str:
        def g(path: str, fmt: str = "{:.3f}") -> str:
            node: Any = r
            for p in path.split("."):
                if not isinstance(node, dict) or p not in node:
                    return "-"
                node = node[p]
            if isinstance(node, list):  # per branch; null (no value) entries left out
                vals = [v for v in node if isinstance(v, (int, float))]
                node = sum(vals) / len(vals) if vals else None
            return fmt.format(node) if isinstance(node, (int, float)) else "-"

        return (f"fold {r.get('fold')} ep {r.get('epoch'):>3} | loss {g('loss.total')} "
                f"c51 {g('loss.c51')} iqn {g('loss.iqn')} moe {g('loss.moe')} | "
                f"Q {g('q.mean', '{:+.3f}')}±{g('q.std')} gap {g('q.gap')} | "
                f"H_moe {g('moe.entropy')} λ {g('moe.lambda_eff', '{:.4f}')} | "
                f"size r/i {g('size.realised_over_intended')} | "
                f"val Sharpe {g('val.sharpe', '{:+.2f}')} ret {g('val.total_return', '{:+.4f}')}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
