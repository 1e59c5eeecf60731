"""Split an FX graph at chosen ops: each split-op call alone, everything between it a piece.

Split ops are named by qualified name (``"ns::op"``), as ``torch.ops.ns.op`` (any
overload) or as a Python callable. :func:`split_graph` keeps ``getitem`` on a split
op's result with the split op, so pieces receive tensors, and records which piece
inputs come from split ops (those are copied into static buffers at replay).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from graphguard.errors import ConfigError

SplitOp = str | torch._ops.OpOverload | torch._ops.OpOverloadPacket | Callable[..., Any]
"""A split op: ``"ns::name"``, ``torch.ops.ns.name`` (any overload), or a Python callable."""


def qualified_op_name(target: Any) -> str | None:
    """An op's qualified ``"ns::name"`` (what split ops match on, any overload), or None
    for a plain callable. (The sanitizer's ``op_name`` is another thing: ``"ns.name"``
    of the overload that ran, for its messages.)"""
    if isinstance(target, torch._ops.OpOverload):
        return str(target._schema.name)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target._qualified_op_name)
    return None


class SplitMatcher:
    """Decides whether an FX node calls a split op.

    Ops match by qualified name (``"ns::name"``), so a packet, any overload and the
    string all select the same op; dynamo records custom ops as packets, AOT graphs
    as overloads. Other callables (e.g. ``torch.nn.functional.scaled_dot_product_attention``)
    match by identity.
    """

    def __init__(self, split_ops: Sequence[SplitOp]) -> None:
        if not isinstance(split_ops, (list, tuple, set, frozenset)):
            raise ConfigError(
                f"split_ops must be a list of the ops that run eagerly between pieces, got "
                f"{type(split_ops).__name__} {split_ops!r:.60}; e.g. "
                "split_ops=['mylib::attention']"
            )
        self.names: set[str] = set()
        self.callables: set[Any] = set()
        for op in split_ops:
            if isinstance(op, str):
                if "::" not in op:
                    raise ConfigError(
                        f"split op {op!r}: give the qualified name 'namespace::op' (e.g. "
                        f"{op.replace('.', '::', 1) if '.' in op else 'mylib::' + op!r})"
                    )
                self.names.add(op.split(".")[0])
                continue
            name = qualified_op_name(op)
            if name is not None:
                self.names.add(name)
            elif callable(op):
                self.callables.add(op)
            else:
                raise ConfigError(f"split op {op!r} is neither an op, its name nor a callable")

    def __call__(self, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        name = qualified_op_name(node.target)
        if name is not None:
            return name in self.names
        try:
            return node.target in self.callables
        except TypeError:
            return False

    def describe(self) -> list[str]:
        return sorted(self.names) + sorted(
            getattr(c, "__qualname__", repr(c)) for c in self.callables
        )


@dataclass
class SplitGraph:
    """The result of splitting one FX graph: the parent module and what its children are."""

    module: torch.fx.GraphModule
    """Parent module; calling it runs pieces and split ops in order."""
    pieces: list[str]
    """Submodule names of the pieces (captured), in call order."""
    split_ops: list[str]
    """Submodule names of the split ops (eager), in call order."""
    copied_inputs: dict[str, list[int]] = field(default_factory=dict)
    """Per piece, the positions of inputs produced by split ops (copied into static buffers)."""


def split_graph(gm: torch.fx.GraphModule, is_split: Callable[[torch.fx.Node], bool]) -> SplitGraph:
    """Split ``gm`` so that each split-op call is alone in a submodule.

    Consecutive non-split nodes form one piece; ``getitem`` on a split op's result
    stays with the split op, so pieces receive tensors, not tuples. A graph without
    split ops is one piece.
    """
    part = 0
    assignment: dict[torch.fx.Node, int] = {}
    split_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        src = node.args[0] if node.args else None
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(src, torch.fx.Node)
            and assignment.get(src) in split_parts
        ):
            assignment[node] = assignment[src]
            continue
        if is_split(node):
            part += 1
            assignment[node] = part
            split_parts.add(part)
            part += 1
        else:
            assignment[node] = part
    parent = split_module(gm, gm, lambda n: assignment[n], keep_original_order=True)
    pieces: list[str] = []
    splits: list[str] = []
    copied: dict[str, list[int]] = {}
    for node in parent.graph.nodes:
        if node.op != "call_module":
            continue
        name = str(node.target)
        if int(name.rsplit("_", 1)[-1]) in split_parts:
            splits.append(name)
            continue
        pieces.append(name)
        idx = []
        for i, arg in enumerate(node.args):
            src = arg
            while (
                isinstance(src, torch.fx.Node)
                and src.op == "call_function"
                and src.target is operator.getitem
            ):
                src = src.args[0]
            if (
                isinstance(src, torch.fx.Node)
                and src.op == "call_module"
                and int(str(src.target).rsplit("_", 1)[-1]) in split_parts
            ):
                idx.append(i)
        copied[name] = idx
    return SplitGraph(parent, pieces, splits, copied)


def graph_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The distinct ops ``gm`` calls, registered ops (``ns::name``) first: for messages."""
    names: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            t = node.target
            names[qualified_op_name(t) or getattr(t, "__qualname__", None) or repr(t)] = None
    return sorted(names, key=lambda n: ("::" not in n, n))


__all__ = ["SplitGraph", "SplitMatcher", "SplitOp", "graph_ops", "split_graph"]
