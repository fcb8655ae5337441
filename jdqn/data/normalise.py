"""Per-feature normalisation fitted on one fold's training rows only.

``fit_normaliser(values, lo, hi)`` sees rows ``[lo, hi)`` and nothing else, so validation and
test rows never leak into the statistics. ``Normaliser.apply`` maps the whole matrix with those
statistics, clips to ±clip and returns float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

SCALE_FLOOR = 1e-8  # a scale below this is degenerate (constant column in the window)
_IQR_TO_SIGMA = 1.3489795003921634  # IQR of a standard normal


@dataclass(frozen=True)
class Normaliser:
    center: np.ndarray  # float64 [F]
    scale: np.ndarray  # float64 [F], ≥ SCALE_FLOOR
    clip: float

    def apply(self, values: np.ndarray) -> np.ndarray:
        """(values − center) / scale, clipped to ±clip → float32 [T, F]."""
        out = (np.asarray(values, np.float64) - self.center) / self.scale
        return np.clip(out, -self.clip, self.clip).astype(np.float32)


def fit_normaliser(values: np.ndarray, lo: int, hi: int,
                   method: Literal["robust", "zscore"] = "robust",
                   clip: float = 5.0) -> Normaliser:
    """Fit on rows ``[lo, hi)`` (callers pass ``cfg.features.normalisation`` / ``clip``).

    robust: center = median, scale = IQR / 1.349 (σ-equivalent for normal data);
    zscore: center = mean, scale = std. A degenerate scale (≤ 1e-8, e.g. a zero-filled column or
    a sparse one with IQR 0) falls back to the std, then to 1 — never to a tiny number that would
    blow a later non-constant value up to ±clip.
    """
    values = np.asarray(values)
    if not 0 <= lo < hi <= values.shape[0] or hi - lo < 2:
        raise ValueError(f"fit_normaliser: need 0 ≤ lo < hi ≤ {values.shape[0]} with at least "
                         f"2 rows, got lo={lo}, hi={hi}")
    x = np.asarray(values[lo:hi], np.float64)
    std = x.std(axis=0)
    if method == "robust":
        q25, center, q75 = np.percentile(x, [25.0, 50.0, 75.0], axis=0)
        scale = (q75 - q25) / _IQR_TO_SIGMA
        scale = np.where(scale > SCALE_FLOOR, scale, std)
    elif method == "zscore":
        center, scale = x.mean(axis=0), std
    else:
        raise ValueError(f"features.normalisation = {method!r}: expected 'robust' or 'zscore'")
    scale = np.where(scale > SCALE_FLOOR, scale, 1.0)
    return Normaliser(center=center, scale=scale, clip=float(clip))
