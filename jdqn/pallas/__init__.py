"""Pallas GPU kernels (SPEC §8) and the switch between them and the plain-JAX reference.

``ModelConfig.impl`` picks the implementation: ``"pallas"``, ``"xla"`` or ``"auto"`` (Pallas on
GPU, XLA elsewhere). Every kernel has a plain-JAX oracle it is tested against on the CPU (in
Pallas' interpreter) and on the GPU (parity, bitwise determinism, speed: ``bench/kernels.py``).

Kernels in this version:

* :func:`jdqn.pallas.projection.project_uniform_pallas` — the categorical L2 projection of the
  branching C51 target (all branches at once), the oracle being
  :func:`jdqn.losses.batch.project_uniform`.

The MoE mixture and the loss's backward pass are not fused kernels in this version: XLA's
own fusions run them (see ``docs/model.md``, "Kernels").
"""

from __future__ import annotations

import jax

Array = jax.Array


def use_pallas(impl: str) -> bool:
    """Whether ``impl`` (``ModelConfig.impl``) selects the Pallas kernels. ``"auto"`` looks at
    the default backend (the trainer places everything there); ``"pallas"`` off the GPU runs
    the kernels in Pallas' interpreter, which is correct but slow — meant for tests."""
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"model.impl = {impl!r}: expected 'auto', 'pallas' or 'xla'")
    return impl == "pallas" or (impl == "auto" and jax.default_backend() == "gpu")


def project_uniform(tz: Array, probs: Array, v_min: float, v_max: float, impl: str) -> Array:
    """The C51 target projection (see :func:`jdqn.losses.batch.project_uniform`) through the
    implementation ``impl`` selects. Off the GPU the Pallas kernel runs in interpret mode."""
    from jdqn.losses.batch import project_uniform as reference

    if not use_pallas(impl):
        return reference(tz, probs, v_min, v_max)
    from jdqn.pallas.projection import project_uniform_pallas

    return project_uniform_pallas(tz, probs, v_min=v_min, v_max=v_max,
                                  interpret=jax.default_backend() != "gpu")
