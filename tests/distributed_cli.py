"""``python tests/distributed_cli.py ARGS`` = ``python -m jdqn.main ARGS`` with two test probes
for the multi-host tests (tests/test_distributed.py), armed on every process but 0:

* it must not write the run folder's files (orbax's checkpoint shards aside): an audit hook
  makes any such open fail, which fails the process;
* its own validation Sharpe is the negative of the true one, so that if process 0's were not
  the one every process decides by, this process would keep other best params than process 0
  and the run would leave the single-process result.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _out_dir() -> Path | None:
    args = sys.argv[1:]
    return Path(args[args.index("--output-dir") + 1]).resolve() if "--output-dir" in args else None


def _arm() -> None:
    import jax

    from jdqn.train import job

    if jax.process_index() == 0:
        return
    out = _out_dir()
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def hook(event: str, args: tuple) -> None:
        if event != "open" or out is None or not isinstance(args[0], (str, bytes, Path)):
            return
        path, mode, flags = args
        writing = (any(c in (mode or "") for c in "wax+") if mode else bool((flags or 0) & writes))
        if not writing:
            return
        p = Path(os.fsdecode(path)).resolve()
        if p.is_relative_to(out) and not p.is_relative_to(out / "checkpoints"):
            raise PermissionError(f"test probe: process {jax.process_index()} wrote {p}")

    sys.addaudithook(hook)
    real = job.compute_metrics

    def flipped(*a, **k):
        m = real(*a, **k)
        return {**m, "sharpe": -m["sharpe"]}

    job.compute_metrics = flipped


if __name__ == "__main__":
    from jdqn import main
    from jdqn.train import distributed

    joined = distributed.initialize

    def initialize(*a, **k):  # arm the probes once the process knows its index
        joined(*a, **k)
        _arm()

    distributed.initialize = initialize
    sys.argv[0] = "jdqn.main"
    main.cli()
