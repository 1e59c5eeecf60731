"""update_weights is all or nothing for every source (issue 29): a meta tensor, a
FakeTensor, and a source sharing memory with a weight the update writes (``w.t()`` of a
live weight, a view of another one) are refused with one ConfigError listing every
problem, before the first copy: every weight keeps its value."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphguard.errors import ConfigError
from tests.test_weights import Net, new_state, runner, values


def _state_for(fill) -> str:
    r, _ = runner()
    model = r.fn
    before = values(model)
    sd = new_state(model)
    fill(model, sd)
    with pytest.raises(ConfigError) as info:  # a GraphGuardError, one for every problem
        r.update_weights(sd)
    after = values(model)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [], f"changed before refusing: {changed}"
    assert "no weight changed" in str(info.value)
    return str(info.value)


def test_a_meta_tensor_in_the_source_is_refused_before_any_copy():
    def fill(model, sd):
        sd["b.weight"] = torch.empty(6, 6, device="meta")  # after a.* and before wide.*

    text = _state_for(fill)
    assert "b.weight: a meta tensor" in text and "materialized" in text


def test_a_fake_tensor_in_the_source_is_refused_before_any_copy():
    with FakeTensorMode():
        fake = torch.empty(6, 6)

    def fill(model, sd):
        sd["wide.weight"] = fake

    text = _state_for(fill)
    assert "wide.weight: a FakeTensor" in text


def test_a_transposed_live_weight_as_its_own_source_is_refused():
    def fill(model, sd):
        sd["b.weight"] = model.b.weight.t()

    text = _state_for(fill)
    assert "b.weight: the source shares memory with its own destination" in text
    assert "pass a copy: source.clone()" in text


def test_a_view_of_another_weight_is_refused_naming_both():
    # Silent wrong before: b.weight got a.weight's *new* values (a was copied first).
    def fill(model, sd):
        sd["b.weight"] = model.a.weight.t()
        sd["scale"] = model.wide.weight[0]  # a slice of another destination

    text = _state_for(fill)
    assert "b.weight: the source shares memory with the module's a.weight" in text
    assert "scale: the source shares memory with the module's wide.weight" in text


def test_a_mixed_source_lists_all_three_problems_at_once():
    def fill(model, sd):
        sd["a.bias"] = torch.empty(6, device="meta")
        sd["b.weight"] = model.wide.weight.t()
        sd["wide.bias"] = torch.zeros(7)

    text = _state_for(fill)
    lines = [ln for ln in text.splitlines() if ln.startswith("  - ")]
    assert len(lines) == 3, text
    assert "a.bias: a meta tensor" in text
    assert "b.weight: the source shares memory with the module's wide.weight" in text
    assert "wide.bias: expected float32 [6], got float32 [7]" in text


def test_a_clone_of_a_live_weight_and_the_weight_itself_are_accepted():
    r, _ = runner()
    model = r.fn
    sd = new_state(model)
    sd["b.weight"] = model.a.weight.t().clone()  # the copy the refusal asks for
    sd["scale"] = model.scale  # the destination itself: nothing to copy
    old_a = model.a.weight.detach().clone()
    up = r.update_weights(sd)
    assert "scale" not in up.copied and "b.weight" in up.copied
    assert torch.equal(model.b.weight, old_a.t())
    assert r.check_weights().ok


def test_strict_false_may_read_a_weight_the_update_does_not_write():
    r, _ = runner()
    model = r.fn
    a = model.a.weight.detach().clone()
    up = r.update_weights({"b.weight": model.a.weight.t()}, strict=False)  # a is not written
    assert up.copied == ("b.weight",)
    assert torch.equal(model.b.weight, a.t()) and torch.equal(model.a.weight, a)


def test_a_module_source_holding_a_meta_weight_is_refused():
    r, _ = runner()
    model = r.fn
    before = values(model)
    with torch.device("meta"):
        other = Net()
    with pytest.raises(ConfigError, match=r"a meta tensor"):
        r.update_weights(other)
    after = values(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
