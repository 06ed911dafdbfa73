"""tests/pairwise.py, the covering-array generator of the config matrix: every pair of values of
every two factors is in some row, forbidden combinations are in none, and the rows are few."""
from __future__ import annotations

import os
from itertools import combinations, product

from hypothesis import given, settings, strategies as st

from pairwise import pairwise

EXAMPLES = int(os.environ.get("MEGATRAIN_HYPOTHESIS_EXAMPLES", "12"))

factor_sets = st.lists(st.integers(2, 4), min_size=2, max_size=6).map(
    lambda sizes: {f"f{k}": list(range(n)) for k, n in enumerate(sizes)})


@settings(max_examples=EXAMPLES, deadline=None)
@given(factor_sets, st.integers(0, 3))
def test_every_pair_is_covered_by_few_rows(factors, seed):
    rows, impossible = pairwise(factors, seed=seed)
    assert not impossible
    for a, b in combinations(factors, 2):
        assert {(r[a], r[b]) for r in rows} == set(product(factors[a], factors[b]))
    sizes = sorted(map(len, factors.values()), reverse=True)
    full = 1
    for n in sizes:
        full *= n
    assert sizes[0] * sizes[1] <= len(rows) <= full
    assert pairwise(factors, seed=seed)[0] == rows   # deterministic


@settings(max_examples=EXAMPLES, deadline=None)
@given(factor_sets)
def test_forbidden_combinations_are_in_no_row_and_reported(factors):
    a, b = list(factors)[:2]
    banned = (factors[a][0], factors[b][-1])

    def allowed(row):
        return (row.get(a), row.get(b)) != banned
    rows, impossible = pairwise(factors, allowed)
    assert all((r[a], r[b]) != banned for r in rows)
    assert impossible == [((a, banned[0]), (b, banned[1]))]
    for x, y in combinations(factors, 2):
        want = {p for p in product(factors[x], factors[y]) if (x, y) != (a, b) or p != banned}
        assert {(r[x], r[y]) for r in rows} == want
