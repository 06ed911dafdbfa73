"""A small deterministic pairwise (strength-2 covering array) generator, for config matrices.

    rows = pairwise({"precision": ["fp32", "bf16"], "accum": [1, 2, 3], "eval": [False, True]})
    # -> a list of dicts; every value of every factor meets every value of every other factor
    #    in at least one row (here 6 rows instead of the 12 of the full product)

Greedy, in the manner of AETG: each new row starts from the first pair not yet covered (in the
factors' order), then gives every other factor the value that covers the most uncovered pairs
with the values chosen so far (ties: the first value). `allowed(row)` (on partial rows: only the
factors chosen so far are keys) excludes combinations; a pair that no allowed row can hold is
returned in `impossible` instead of covered. Deterministic: the same factors give the same rows.
"""
from __future__ import annotations

from itertools import combinations
from typing import Any, Callable, Sequence

Row = dict[str, Any]


def _pairs(factors: dict[str, Sequence]) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """Every pair of (factor, value index) of two factors, in the factors' order."""
    names = list(factors)
    return [((a, i), (b, j)) for a, b in combinations(names, 2)
            for i in range(len(factors[a])) for j in range(len(factors[b]))]


def pairs_of(row: Row, factors: dict[str, Sequence]) -> set:
    """The pairs a (complete or partial) row covers, as (factor, value index) pairs."""
    index = {name: list(values).index(row[name]) for name, values in factors.items() if name in row}
    names = [n for n in factors if n in index]
    return {((a, index[a]), (b, index[b])) for a, b in combinations(names, 2)}


def _completes(partial: Row, factors: dict[str, Sequence], allowed: Callable[[Row], bool]) -> Row | None:
    """`partial` completed into an allowed row (first values first), or None when none is."""
    missing = [n for n in factors if n not in partial]
    if not missing:
        return partial if allowed(partial) else None
    name = missing[0]
    for value in factors[name]:
        row = {**partial, name: value}
        if allowed(row):
            done = _completes(row, factors, allowed)
            if done is not None:
                return done
    return None


def pairwise(factors: dict[str, Sequence], allowed: Callable[[Row], bool] = lambda row: True
             ) -> tuple[list[Row], list[tuple]]:
    """(rows, impossible pairs): allowed rows covering every pair an allowed row can hold."""
    todo = set(_pairs(factors))
    order = _pairs(factors)
    rows: list[Row] = []
    impossible = []
    while todo:
        (a, i), (b, j) = next(p for p in order if p in todo)
        row = {a: factors[a][i], b: factors[b][j]}
        if _completes(row, factors, allowed) is None:
            todo.discard(((a, i), (b, j)))
            impossible.append(((a, factors[a][i]), (b, factors[b][j])))
            continue
        for name in factors:
            if name in row:
                continue
            best, best_gain = None, -1
            for value in factors[name]:
                trial = {**row, name: value}
                if _completes(trial, factors, allowed) is None:
                    continue
                gain = len(pairs_of(trial, factors) & todo)
                if gain > best_gain:
                    best, best_gain = value, gain
            row[name] = best
        row = {name: row[name] for name in factors}
        todo -= pairs_of(row, factors)
        rows.append(row)
    return rows, impossible
