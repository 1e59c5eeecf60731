"""One tensor walker (``graphguard.walk.Walker``): its limits are parameters, and the
sanitizer's name table is the same walker with shallower limits and its own hooks."""

from __future__ import annotations

import types

import torch

from graphguard.sanitizer.names import Names
from graphguard.walk import ATTR, ITEM, Walker, reachable_tensors


def _names(w: Walker) -> list[str]:
    return [n for n, _ in w.out]


def _nested(levels: int, leaf: torch.Tensor) -> dict:
    d: dict = {"t": leaf}
    for i in range(levels):
        d = {f"l{i}": d}
    return d


def test_max_depth_cuts_the_walk() -> None:
    deep = _nested(3, torch.zeros(1))  # the tensor sits 4 levels below the root
    shallow = Walker(max_depth=3)
    shallow.visit(deep, "root")
    assert shallow.out == []
    enough = Walker(max_depth=4)
    enough.visit(deep, "root")
    assert _names(enough) == ["root['l2']['l1']['l0']['t']"]


def test_max_items_cuts_one_container() -> None:
    ts = [torch.zeros(1) for _ in range(5)]
    w = Walker(max_items=3)
    w.visit(ts, "xs")
    assert _names(w) == ["xs[0]", "xs[1]", "xs[2]"]


def test_max_nodes_bounds_the_objects_opened() -> None:
    objs = [types.SimpleNamespace(t=torch.zeros(1)) for _ in range(10)]
    w = Walker(max_nodes=4)  # the list and three namespaces
    w.visit(objs, "objs")
    assert _names(w) == ["objs[0].t", "objs[1].t", "objs[2].t"]


def test_a_tensor_bound_twice_is_reported_once_or_at_each_binding() -> None:
    t = torch.zeros(2)
    holder = {"a": t, "b": t}
    once = Walker()
    once.visit(holder, "")
    assert _names(once) == ["a"]
    slots: list = []

    class Every(Walker):
        def tensor(self, x, name, slot):
            slots.append((name, slot[1], slot[2]))

    Every(dedupe_tensors=False).visit(holder, "")
    assert slots == [("a", "a", ITEM), ("b", "b", ITEM)]


def test_attributes_record_their_slot() -> None:
    obj = types.SimpleNamespace(cache=torch.zeros(3))
    seen: list = []

    class Slots(Walker):
        def tensor(self, x, name, slot):
            seen.append((name, slot))

    Slots().visit(obj, "step")
    assert seen == [("step.cache", (obj, "cache", ATTR))]


def test_reachable_tensors_walks_six_levels_and_the_name_table_two() -> None:
    leaf = torch.ones(4)
    deep = _nested(2, leaf)  # 3 levels below the closure variable

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + deep["l1"]["l0"]["t"]

    assert [n for n, t in reachable_tensors(step) if t is leaf] == ["deep['l1']['l0']['t']"]
    names = Names()
    names.scan_callable(step)
    assert leaf.untyped_storage().data_ptr() not in names.by_ptr  # beyond Names.DEPTH
    near = {"t": leaf}

    def step2(x: torch.Tensor) -> torch.Tensor:
        return x + near["t"]

    names = Names()
    names.scan_callable(step2)
    assert names.by_ptr[leaf.untyped_storage().data_ptr()] == "near['t']"
    assert isinstance(names._walker, Walker)


def test_the_name_table_names_parameters_and_keeps_their_bindings() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    names = Names()
    names.scan(m, "model")
    ptr = m[0].weight.untyped_storage().data_ptr()
    assert names.by_ptr[ptr] == "parameter model.0.weight"
    (binding,) = names.bindings[ptr]
    assert binding.path == "model.0.weight" and not binding.rebound()
    m[0].weight = torch.nn.Parameter(torch.zeros(2, 2))
    assert binding.rebound()
