"""A cheaper walk of a new FX node's arguments while the passes run.

torch 2.13's `Graph.create_node` walks every new node's arguments with pytree to warn about raw
SymInt/SymFloat/SymBool values (graph.py: `for val in pytree.tree_iter((args, kwargs))`). The
passes copy the whole depth's nodes (layer calls put back in line, segments cut out): at 64
layers of a tiny Llama that walk was 60% of `inline_layer_regions` (pytree looks each container
up in its registry). While the pipeline runs, the walk is this one: tuples, lists and dicts
descended by type, anything else a leaf. The same leaves reach the same warning; only pytree
classes of other kinds (named tuples, registered dataclasses) are not descended into, and no pass
puts a raw symbolic value inside one.

    with plain_arg_walk():          # torch.fx.graph's `pytree` is a view of torch.utils._pytree
        gm = some_pass(gm, ctx)     # whose tree_iter is `_leaves`; restored on exit
"""
from __future__ import annotations

import contextlib

import torch.fx.graph as fx_graph
from torch.fx.immutable_collections import immutable_dict, immutable_list


_SEQUENCES = frozenset({tuple, list, immutable_list})
_MAPPINGS = frozenset({dict, immutable_dict})


def _leaves(tree) -> list:
    out, stack = [], [tree]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind in _SEQUENCES:
            stack.extend(value)
        elif kind in _MAPPINGS:
            stack.extend(value.values())
        else:
            out.append(value)
    return out


class _PlainWalk:
    """torch.utils._pytree as torch.fx.graph sees it, with `tree_iter` replaced."""

    def __init__(self, pytree):
        self._pytree = pytree

    def __getattr__(self, name):
        return getattr(self._pytree, name)

    @staticmethod
    def tree_iter(tree):
        return _leaves(tree)


@contextlib.contextmanager
def plain_arg_walk():
    """`Graph.create_node`'s argument walk as `_leaves` for the length of the block (reentrant)."""
    current = fx_graph.pytree
    if isinstance(current, _PlainWalk):
        yield
        return
    fx_graph.pytree = _PlainWalk(current)
    try:
        yield
    finally:
        fx_graph.pytree = current
