"""A small deterministic pairwise (strength-2 covering array) generator, for config matrices.

    rows, impossible = pairwise({"precision": ["fp32", "bf16"], "accum": [1, 2, 3], "eval": [False, True]})
    # rows: a list of dicts; every value of every factor meets every value of every other factor
    # in at least one row (here 6 rows instead of the 12 of the full product)

Two stages, both seeded (the same factors and seed give the same rows):
  1. greedy, in the manner of AETG: each new row starts from the first pair not yet covered and
     gives every other factor the value that covers the most uncovered pairs with the values
     chosen so far. This always finishes and bounds the row count.
  2. a local search for fewer rows: from the lower bound (the product of the two largest factor
     sizes) up to the greedy count minus one, N random rows are repaired move by move (set two
     factors of one row to an uncovered pair's values, keeping the move that leaves the fewest
     pairs uncovered) within a fixed budget; the first N that covers every pair wins.
`allowed(row)` (on partial rows: only the factors chosen so far are keys) excludes
combinations; a pair that no allowed row can hold is returned in `impossible` instead.
`required` rows (a case that must be run as it is, whatever pairs it adds) come first and count
as covering their pairs.
"""
from __future__ import annotations

import random
from itertools import combinations
from typing import Any, Callable, Sequence

Row = dict[str, Any]
Pair = tuple[tuple[str, int], tuple[str, int]]


def _pairs(factors: dict[str, Sequence]) -> list[Pair]:
    """Every pair of (factor, value index) of two factors, in the factors' order."""
    return [((a, i), (b, j)) for a, b in combinations(list(factors), 2)
            for i in range(len(factors[a])) for j in range(len(factors[b]))]


def pairs_of(row: Row, factors: dict[str, Sequence]) -> set[Pair]:
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


def _greedy(factors, allowed, todo: set[Pair]) -> list[Row]:
    order = _pairs(factors)
    rows = []
    while todo:
        (a, i), (b, j) = next(p for p in order if p in todo)
        row = {a: factors[a][i], b: factors[b][j]}
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
    return rows


def _search(factors, allowed, wanted: set[Pair], n: int, rng: random.Random, budget: int) -> list[Row] | None:
    """n rows covering `wanted`, or None within `budget` moves. Rows are kept as lists of value
    indices and pair counts in a dict keyed by (factor a, index, factor b, index) positions."""
    names = list(factors)
    sizes = [len(factors[k]) for k in names]
    links = list(combinations(range(len(names)), 2))
    want = {(names.index(a), i, names.index(b), j) for (a, i), (b, j) in wanted}

    def as_row(idx: list[int]) -> Row:
        return {k: factors[k][v] for k, v in zip(names, idx)}

    def covered(idx: list[int]):
        return [(x, idx[x], y, idx[y]) for x, y in links]

    rows = []
    for _ in range(n):
        idx = [rng.randrange(m) for m in sizes]
        if not allowed(as_row(idx)):
            done = _completes({}, factors, allowed)
            idx = [list(factors[k]).index(done[k]) for k in names]
        rows.append(idx)
    count: dict[tuple, int] = {}
    for idx in rows:
        for p in covered(idx):
            count[p] = count.get(p, 0) + 1
    for _ in range(budget):
        left = [p for p in want if not count.get(p)]
        if not left:
            return [as_row(idx) for idx in rows]
        x, i, y, j = rng.choice(sorted(left))
        best, best_score = None, None
        for r, idx in enumerate(rows):
            trial = list(idx)
            trial[x], trial[y] = i, j
            before, after = set(covered(idx)), set(covered(trial))
            score = (sum(1 for p in after - before if p in want and not count.get(p))
                     - sum(1 for p in before - after if p in want and count[p] == 1))
            if (best_score is None or score > best_score or (score == best_score and rng.random() < 0.5)) \
                    and allowed(as_row(trial)):
                best, best_score = r, score
        if best is None:
            continue
        for p in covered(rows[best]):
            count[p] -= 1
        rows[best] = list(rows[best])
        rows[best][x], rows[best][y] = i, j
        for p in covered(rows[best]):
            count[p] = count.get(p, 0) + 1
    return None


def pairwise(factors: dict[str, Sequence], allowed: Callable[[Row], bool] = lambda row: True,
             seed: int = 0, budget: int = 2000, required: Sequence[Row] = ()) -> tuple[list[Row], list[tuple]]:
    """(rows, impossible pairs): allowed rows covering every pair an allowed row can hold. The
    `required` rows come first, as given; the others cover what they leave."""
    wanted, impossible = set(), []
    for (a, i), (b, j) in _pairs(factors):
        if _completes({a: factors[a][i], b: factors[b][j]}, factors, allowed) is None:
            impossible.append(((a, factors[a][i]), (b, factors[b][j])))
        else:
            wanted.add(((a, i), (b, j)))
    fixed = [{k: row[k] for k in factors} for row in required]
    for row in fixed:
        wanted -= pairs_of(row, factors)
    rows = _greedy(factors, allowed, set(wanted))
    sizes = sorted((len(v) for v in factors.values()), reverse=True)
    floor = sizes[0] * sizes[1] - len(fixed) if len(sizes) > 1 else 1
    rng = random.Random(seed)
    for n in range(max(floor, 1), len(rows)):
        found = _search(factors, allowed, wanted, n, rng, budget)
        if found is not None:
            return fixed + found, impossible
    return fixed + rows, impossible
