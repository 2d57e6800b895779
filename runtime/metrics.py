"""Evaluation metrics of the generated trainer (numpy only).

`roc_auc(labels, scores)` is the area under the ROC curve, computed exactly as the
Mann-Whitney statistic: the probability that a random positive scores higher than a
random negative, ties counting one half. It equals sklearn's `roc_auc_score` and needs
no threshold sweep, so it is exact for any number of tied scores.
"""

from __future__ import annotations

import math

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """AUC of `scores` for binary `labels` (0/1); NaN when one class is absent.

    Raises ValueError when the arrays differ in length or labels are not 0/1.
    """
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length ({y.size} vs {s.size})")
    if y.size and not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 or 1")
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    pos = int(np.count_nonzero(y == 1))
    neg = y.size - pos
    if pos == 0 or neg == 0:
        return math.nan
    ranks = _average_ranks(s)
    rank_sum = float(ranks[y == 1].sum())
    return (rank_sum - pos * (pos + 1) / 2.0) / (pos * neg)


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of `x`, tied values sharing the mean of their ranks."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    # boundaries of runs of equal values in sorted order
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], x.size]
    mean_rank = (starts + ends + 1) / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def log_loss(labels: np.ndarray, probabilities: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of predicted probabilities (clipped to [eps, 1 - eps])."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(probabilities, dtype=np.float64).reshape(-1), eps, 1 - eps)
    if y.size == 0:
        return math.nan
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
