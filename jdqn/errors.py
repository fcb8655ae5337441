"""Errors that reach the user. The CLI prints their message on one line and exits with code 2.

Every message names the thing (file, row, field, tensor, checkpoint) and the problem.
"""


class JdqnError(Exception):
    """Base of every user-facing jdqn error."""


class DataError(JdqnError, ValueError):
    """Bad input data: missing column, NaN/non-positive price, bad timestamps, empty file, …"""


class CacheError(DataError):
    """A feature-cache file that cannot be used (foreign schema, corrupt)."""


class CheckpointError(JdqnError):
    """A checkpoint that cannot be restored (corrupt, foreign layout, missing)."""


class LogError(JdqnError):
    """A run's log (``metrics.jsonl``) that a resume cannot continue (a damaged line)."""


class TrainingHalted(JdqnError):
    """Training stopped by a safety check (non-finite tensor, Q drift)."""


class DistributedError(JdqnError):
    """Another process of a multi-host job failed, or the processes were not started alike."""
