"""Declarative fold-boundary reset policy: one rule for every leaf of the train state.

The predecessor's worst bugs were resets it forgot (the IQN target network, seven auxiliary
optimisers, a readiness gauge). Here a policy is a *prefix tree* of the state whose leaves are
rules; a rule at a node covers that whole subtree (e.g. one rule for all of ``opt_state``).
:func:`check_policy_covers` fails, naming every uncovered leaf path and every rule that matches
no node, so adding a state leaf without deciding its reset cannot go unnoticed.

Policies match the state **by name**: path components are attribute names (dataclasses,
NamedTuples), dict keys and sequence indices, compared as strings. A policy can therefore be the
state's own type (``TrainState(params=ShrinkPerturb(0.8, 0.01), ...)``) or a nested ``dict``
(``{"params": ShrinkPerturb(0.8, 0.01), "opt_state": {...}}``), whichever reads better.
``None`` in the state is a leaf that needs a rule like any other (rules leave it ``None``), so
an optional component cannot slip through; empty containers have no leaves and need none.

Order of evaluation (what :func:`apply_reset` guarantees):

1. every rule except :class:`CopyFrom` is evaluated on the **old** state (and the fresh state);
2. then every :class:`CopyFrom` is resolved; by default it reads the **new** value of its source
   (after that source's own rule), following chains of ``CopyFrom`` (cycles are an error). With
   ``CopyFrom(src, new=False)`` it reads the old value instead.

So "shrink-and-perturb the params, then hard-sync target = the new params" is
``params=ShrinkPerturb(...), target_params=CopyFrom("params")``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jdqn.errors import JdqnError

PyTree = Any
Path = tuple[str, ...]


class ResetPolicyError(JdqnError, ValueError):
    """A reset policy that does not fit the state (uncovered leaves, stray rules, bad copies)."""


class Rule(abc.ABC):
    """Base of all reset rules. Rules are pytree *leaves* (not registered as nodes)."""

    needs_fresh = False
    needs_key = False

    @abc.abstractmethod
    def apply(self, old: Any, fresh: Any, key: jax.Array | None, where: str) -> Any:
        """The leaf's new value from its ``old`` value (and ``fresh`` / ``key`` when needed)."""


@dataclasses.dataclass(frozen=True)
class Keep(Rule):
    """Carry the value over unchanged (e.g. the replay buffer, normaliser statistics)."""

    def apply(self, old, fresh, key, where):
        return old


@dataclasses.dataclass(frozen=True)
class Zero(Rule):
    """Set to zeros of the same shape and dtype (moments, counters, flags)."""

    def apply(self, old, fresh, key, where):
        _no_keys(old, self, where)
        return jnp.zeros_like(old)


@dataclasses.dataclass(frozen=True)
class Fill(Rule):
    """Set every element to ``value`` (cast to the leaf's dtype)."""

    value: float | int | bool = 0

    def apply(self, old, fresh, key, where):
        _no_keys(old, self, where)
        return jnp.full_like(old, self.value)


@dataclasses.dataclass(frozen=True)
class Reinit(Rule):
    """Re-initialise: ``fn(key, old_leaf) -> new_leaf`` with a per-leaf key (``fold_in`` of the
    reset key by leaf index), or, without ``fn``, take the leaf of ``fresh_state``."""

    fn: Callable[[jax.Array, Any], Any] | None = None

    @property
    def needs_fresh(self) -> bool:  # type: ignore[override]
        return self.fn is None

    @property
    def needs_key(self) -> bool:  # type: ignore[override]
        return self.fn is not None

    def apply(self, old, fresh, key, where):
        new = fresh if self.fn is None else self.fn(key, old)
        _same_layout(old, new, self, where)
        return new


@dataclasses.dataclass(frozen=True)
class ShrinkPerturb(Rule):
    """``θ ← shrink·θ + perturb·θ_fresh`` (Ash & Adams 2020, "On Warm-Starting Neural Network
    Training"), with ``θ_fresh`` the leaf of a freshly initialised state (new init key)."""

    shrink: float
    perturb: float
    needs_fresh = True

    def apply(self, old, fresh, key, where):
        if not jnp.issubdtype(jnp.asarray(old).dtype, jnp.floating):
            raise ResetPolicyError(f"ShrinkPerturb at {where}: leaf dtype {old.dtype} is not "
                                   "floating point; use Keep() or Reinit() there")
        _same_layout(old, fresh, self, where)
        return (self.shrink * old + self.perturb * fresh).astype(old.dtype)


@dataclasses.dataclass(frozen=True)
class CopyFrom(Rule):
    """Copy the subtree at ``source`` (dotted names, e.g. ``"params"`` or ``"iqn.params"``),
    which must have the same structure, shapes and dtypes. ``new=True`` (default) reads the
    source's value *after* its own rule; ``new=False`` reads its old value."""

    source: str | Sequence[str]
    new: bool = True

    def apply(self, old, fresh, key, where):
        # A copy reads another leaf, which one leaf's rule cannot see: apply_reset resolves
        # every CopyFrom itself, after the other rules (see the module docstring).
        raise ResetPolicyError(f"{self!r} at {where} is resolved by apply_reset, not per leaf")

    @property
    def source_path(self) -> Path:
        if isinstance(self.source, str):
            return tuple(p for p in self.source.split(".") if p)
        return tuple(str(p) for p in self.source)


# ---------------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------------


def _name(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _fmt(path: Path) -> str:
    return ".".join(path) if path else "<root>"


def _is_none(x: Any) -> bool:
    return x is None


def _state_leaves(state: PyTree) -> tuple[list[tuple[Path, Any]], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_none)
    return [(tuple(_name(k) for k in p), x) for p, x in flat], treedef


def _node_paths(tree: PyTree, prefix: Path = ()) -> set[Path]:
    """Paths of every node (internal and leaf) of ``tree``, by one-level flattening."""
    out = {prefix}
    children, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    for p, child in children:
        if len(p) == 0:  # ``tree`` is itself a leaf
            continue
        out |= _node_paths(child, prefix + tuple(_name(k) for k in p))
    return out


def _rules(policy: PyTree) -> list[tuple[Path, Rule]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(policy, is_leaf=lambda x: isinstance(x, Rule))
    out, bad = [], []
    for p, r in flat:
        path = tuple(_name(k) for k in p)
        if isinstance(r, Rule):
            out.append((path, r))
        else:
            bad.append(f"{_fmt(path)} = {r!r}")
    if bad:
        raise ResetPolicyError("reset policy entries that are not rules (use Keep(), Zero(), "
                               "Fill(), Reinit(), ShrinkPerturb() or CopyFrom()): "
                               + "; ".join(bad))
    return out


def _owner(path: Path, rules: list[tuple[Path, Rule]]) -> int | None:
    for j, (rp, _) in enumerate(rules):
        if path[: len(rp)] == rp:
            return j
    return None


def _plan(policy: PyTree, state: PyTree) -> tuple[list[tuple[Path, Rule]], list[int]]:
    rules = _rules(policy)
    leaves, _ = _state_leaves(state)
    nodes = _node_paths(state)
    problems = []
    owners = []
    for path, _ in leaves:
        j = _owner(path, rules)
        owners.append(j)
        if j is None:
            problems.append(f"no rule for state leaf '{_fmt(path)}'")
    for rp, r in rules:
        if rp not in nodes:
            problems.append(f"rule {r!r} at '{_fmt(rp)}' matches nothing in the state")
        if isinstance(r, CopyFrom) and r.source_path not in nodes:
            problems.append(f"rule {r!r} at '{_fmt(rp)}': source '{_fmt(r.source_path)}' is not "
                            "in the state")
    nested = [(a, b) for a, _ in rules for b, _ in rules if a != b and b[: len(a)] == a]
    problems += [f"rules at '{_fmt(a)}' and '{_fmt(b)}' overlap" for a, b in nested]
    if problems:
        raise ResetPolicyError("reset policy does not fit the state:\n  " + "\n  ".join(problems))
    return rules, owners  # type: ignore[return-value]


def check_policy_covers(policy: PyTree, state: PyTree) -> None:
    """Raise :class:`ResetPolicyError` naming every state leaf without a rule and every rule (or
    ``CopyFrom`` source) that matches nothing. Structure only: works on abstract states too."""
    _plan(policy, state)


def describe(policy: PyTree, state: PyTree) -> list[str]:
    """One line per state leaf: ``path: rule`` (for logs and docs)."""
    rules, owners = _plan(policy, state)
    leaves, _ = _state_leaves(state)
    return [f"{_fmt(p)}: {rules[j][1]!r}" for (p, _), j in zip(leaves, owners, strict=True)]


# ---------------------------------------------------------------------------------------------
# application
# ---------------------------------------------------------------------------------------------


def _no_keys(x: Any, rule: Rule, where: str) -> None:
    if x is not None and jax.dtypes.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
        raise ResetPolicyError(f"{rule!r} at {where}: cannot apply to a PRNG key; use Keep() or "
                               "Reinit()")


def _same_layout(old: Any, new: Any, rule: Rule, where: str) -> None:
    if old is None and new is None:
        return
    if (jnp.shape(old), jnp.asarray(old).dtype) != (jnp.shape(new), jnp.asarray(new).dtype):
        raise ResetPolicyError(
            f"{rule!r} at {where}: new value {jnp.shape(new)} {jnp.asarray(new).dtype} does not "
            f"match the old {jnp.shape(old)} {jnp.asarray(old).dtype}")


def apply_reset(policy: PyTree, state: PyTree, key: jax.Array | None = None,
                fresh_state: PyTree | None = None) -> PyTree:
    """The state after the fold-boundary reset (same structure, shapes and dtypes).

    ``fresh_state`` (same structure as ``state``, e.g. ``init_train_state(new_key)``) is needed by
    ``Reinit()`` without ``fn`` and by ``ShrinkPerturb``; ``key`` by ``Reinit(fn)``. Pure and
    jittable when the policy is static (close over it).
    """
    rules, owners = _plan(policy, state)
    leaves, treedef = _state_leaves(state)
    index = {p: i for i, (p, _) in enumerate(leaves)}
    fresh: list[Any] | None = None
    if any(r.needs_fresh for _, r in rules):
        if fresh_state is None:
            names = [repr(r) for _, r in rules if r.needs_fresh]
            raise ResetPolicyError(f"apply_reset: {', '.join(names)} need a fresh_state")
        fl, _ = _state_leaves(fresh_state)
        if [p for p, _ in fl] != [p for p, _ in leaves]:
            raise ResetPolicyError("apply_reset: fresh_state does not have the state's structure")
        fresh = [x for _, x in fl]
    if key is None and any(r.needs_key for _, r in rules):
        raise ResetPolicyError("apply_reset: Reinit(fn) rules need a key")

    new: list[Any] = [None] * len(leaves)
    done = [False] * len(leaves)
    for i, ((path, old), j) in enumerate(zip(leaves, owners, strict=True)):
        rule = rules[j][1]
        if isinstance(rule, CopyFrom):
            continue
        if old is None:
            new[i], done[i] = None, True
            continue
        k = jax.random.fold_in(key, i) if rule.needs_key else None
        f = fresh[i] if fresh is not None else None
        new[i], done[i] = rule.apply(old, f, k, f"'{_fmt(path)}'"), True

    def resolve(i: int, chain: tuple[int, ...]) -> Any:
        if done[i]:
            return new[i]
        if i in chain:
            cyc = " → ".join(_fmt(leaves[c][0]) for c in (*chain, i))
            raise ResetPolicyError(f"CopyFrom cycle: {cyc}")
        rp, rule = rules[owners[i]]
        path = leaves[i][0]
        src_path = rule.source_path + path[len(rp):]
        if src_path not in index:
            raise ResetPolicyError(f"{rule!r} at '{_fmt(rp)}': the source has no leaf "
                                   f"'{_fmt(src_path)}' for '{_fmt(path)}'")
        s = index[src_path]
        val = resolve(s, (*chain, i)) if rule.new else leaves[s][1]
        _same_layout(leaves[i][1], val, rule, f"'{_fmt(path)}'")
        new[i], done[i] = val, True
        return val

    for (rp, rule) in rules:
        if isinstance(rule, CopyFrom):
            dst = {p[len(rp):] for p, _ in leaves if p[: len(rp)] == rp}
            src_root = rule.source_path
            src = {p[len(src_root):] for p, _ in leaves if p[: len(src_root)] == src_root}
            if dst != src:
                diff = sorted(_fmt(s) for s in dst ^ src)[:5]
                raise ResetPolicyError(f"{rule!r} at '{_fmt(rp)}': source and destination "
                                       f"differ in structure (e.g. {', '.join(diff)})")
    for i in range(len(leaves)):
        resolve(i, ())
    return jax.tree_util.tree_unflatten(treedef, new)
