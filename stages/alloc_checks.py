"""What makes a receiver's alloc unacceptable: the rules the sender applies before it
writes anything into a receiver's memory. Pure functions over allocs and the room's
shape; the sender fails the room with the reason they return.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ipc.wire import Alloc


@dataclass(frozen=True)
class RowShape:
    """The embedding rows this worker writes: every alloc must name the same shape."""
    hidden: int
    dtype: str
    deepstack_width: int


def alloc_problem(a: Alloc, spans: Sequence[int], taken: Sequence[Alloc], shape: RowShape) -> str | None:
    """Why `a` cannot be taken for a room whose items have `spans` rows each, where `taken`
    are the allocs already taken for its item; None if it can."""
    if a.item >= len(spans):
        return f"alloc for item {a.item} but the room has {len(spans)} items"
    span = spans[a.item]
    if a.span != span:
        return f"alloc for item {a.item} says span {a.span}; the worker's span is {span}"
    if a.hidden != shape.hidden:
        return f"alloc for item {a.item} says hidden {a.hidden}; the embedding's is {shape.hidden}"
    if a.dtype != shape.dtype:
        return f"alloc for item {a.item} says dtype {a.dtype}; the embedding's is {shape.dtype}"
    if a.deepstack_width != shape.deepstack_width:
        return (f"alloc for item {a.item} says deepstack_width {a.deepstack_width}; "
                f"the embedding's is {shape.deepstack_width}")
    if taken and a.fanout != taken[0].fanout:
        return f"allocs for item {a.item} disagree on fanout ({taken[0].fanout} and {a.fanout})"
    if len(taken) >= a.fanout:
        return f"more allocs for item {a.item} than its fanout {a.fanout}"
    if a.row_start + a.n_rows > span:
        return (f"alloc for item {a.item} takes rows [{a.row_start}, {a.row_start + a.n_rows}) "
                f"beyond the span {span}")
    if a.n_rows and not a.dst:
        return f"alloc for item {a.item} has rows but dst 0"
    if a.n_rows and shape.deepstack_width and not a.dst_deepstack:
        return f"alloc for item {a.item} has rows but dst_deepstack 0 and the model has deepstack"
    return None


def tiling_problem(item: int, span: int, allocs: Sequence[Alloc]) -> str | None:
    """Why the shards of an item's allocs (all its fanout's) do not cover its `span` rows
    exactly once, nor are all full copies (identity broadcast); None if they do or are."""
    if span and all(a.row_start == 0 and a.n_rows == span for a in allocs):
        return None
    shards = sorted((a.row_start, a.n_rows) for a in allocs if a.n_rows)
    pos = 0
    for start, n in shards:
        if start > pos:
            return f"shards of item {item} leave rows [{pos}, {start}) unassigned"
        if start < pos:
            return f"shards of item {item} overlap at row {start}"
        pos = start + n
    if pos != span:
        return f"shards of item {item} cover rows [0, {pos}) of a span of {span}"
    return None
