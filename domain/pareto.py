"""Pareto frontier of throughput vs per-user speed (both maximised).

The frontier phase sweeps the finalists' concurrency; each point is (tok/s/user, output
tok/s/GPU). A point is *dominated* when another is at least as good on both axes and better on
one; the frontier is the set of points no other dominates. Ties (equal on both axes) keep the
first point only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated when maximising both coordinates.

    Args:
        points: (x, y) pairs, e.g. (tok/s/user, tok/s/GPU).

    Returns:
        Indices of the frontier sorted by increasing x.
    """
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1], i))
    front, best_y = [], -math.inf
    for i in order:
        if points[i][1] > best_y:
            front.append(i)
            best_y = points[i][1]
    return sorted(front, key=lambda i: points[i][0])


def dominated_by(points: Sequence[tuple[float, float]]) -> dict[int, int]:
    """For every point off the frontier, the index of a frontier point that dominates it.

    The dominating point chosen is the frontier point with the largest y among those at least
    as good on both axes (ties by index), so a reader sees which configuration beats it.
    """
    front = pareto_front(points)
    out: dict[int, int] = {}
    for i, (x, y) in enumerate(points):
        if i in front:
            continue
        better = [j for j in front if points[j][0] >= x and points[j][1] >= y]
        out[i] = max(better, key=lambda j: (points[j][1], -j))
    return out
