"""Fused Pallas GPU kernels (SPEC §8): branching C51 loss, MoE mixture, deterministic reductions.

Not in this version: the plain-JAX path in ``jdqn.networks`` / ``jdqn.losses`` is what runs
everywhere and is the reference these kernels will be tested against.
"""
