"""What produced a run: the software versions and the device kind that ``report.json`` records
(``extra.versions``, ``extra.device_kind``), and a warning when the running JAX is not one the
project is tested on.

Bitwise results depend on more than the config and the seed: on the JAX/XLA version that
compiled the programs, on the device, and on a CPU host's vector instructions (XLA compiles for
the host it runs on: the quickstart's ``returns.csv`` differs between AVX2-only and AVX-512
machines, each bitwise repeatable). The report names the first two, so two runs' bits can be
compared knowing what made them.

``pyproject.toml`` admits only the tested JAX versions, but an environment installed without
the pins (a prebuilt GPU image, ``pip install --no-deps``) may carry another one; jax 0.11
deprecates Pallas' Triton backend, which most kernels in :mod:`jdqn.pallas` lower through, so a
later JAX is warned about when a job starts (README, "Development").
"""

from __future__ import annotations

import platform
import warnings
from importlib.metadata import PackageNotFoundError, version

# (major, minor) of the JAX versions the suite and the GPU tests run on: CI (0.10, Python
# 3.11) and the GPU machines (0.11); pyproject.toml's pins say the same
TESTED_JAX = ((0, 10), (0, 11))

# The distributions whose versions a report records (beside Python and jdqn itself)
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy")


def versions() -> dict[str, str | None]:
    """``{"python": …, "jdqn": …, "jax": …, …}``: the versions of Python, jdqn and
    :data:`PACKAGES` in this process (``None`` for a package that is not installed). JAX's is
    the imported module's own."""
    import jax

    import jdqn

    out: dict[str, str | None] = {"python": platform.python_version(),
                                  "jdqn": jdqn.__version__}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    out["jax"] = jax.__version__
    return out


def _major_minor(v: str) -> tuple[int, int] | None:
    parts = v.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def untested_jax(jax_version: str) -> str | None:
    """A one-line warning when ``jax_version`` is not a tested version
    (:data:`TESTED_JAX`), else ``None``."""
    if _major_minor(jax_version) in TESTED_JAX:
        return None
    tested = " and ".join(f"{a}.{b}" for a, b in TESTED_JAX)
    return (f"jax {jax_version} is not a version jdqn is tested on ({tested}): results may "
            "differ from a tested install, and the GPU kernels may not compile (jax 0.11 "
            "deprecates Pallas' Triton backend); model.impl = \"xla\" avoids the kernels")


def warn_if_untested_jax() -> None:
    """Warn (``UserWarning``) when the running JAX is not a tested version."""
    import jax

    msg = untested_jax(jax.__version__)
    if msg is not None:
        warnings.warn(msg, stacklevel=2)
