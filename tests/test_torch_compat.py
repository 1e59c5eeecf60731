"""The one home of torch internals: non-owning aliases, size_oblivious, guard failures."""

from __future__ import annotations

import types

import torch

from graphguard import _torch_compat
from graphguard._torch_compat import GuardFailures, code_site, size_oblivious, unowned


def test_unowned_views_the_same_memory_with_the_same_layout_through_a_fresh_storage():
    base = torch.arange(24.0).reshape(4, 6)
    t = base[1:, ::2]  # offset and strides that a naive alias would lose
    alias = unowned(t)
    assert alias.data_ptr() == t.data_ptr()
    assert alias.shape == t.shape and alias.stride() == t.stride()
    assert alias.storage_offset() == t.storage_offset()
    assert alias.untyped_storage()._cdata != t.untyped_storage()._cdata
    base.add_(1)
    torch.testing.assert_close(alias, t)  # writes through the owner are seen


def test_unowned_under_inference_mode_is_an_inference_tensor_unless_asked_otherwise():
    with torch.inference_mode():
        t = torch.ones(3)
        assert unowned(t).is_inference()
        with torch.inference_mode(False):
            assert not unowned(t).is_inference()


def test_size_oblivious_turns_backed_size_oblivious_on_only_inside():
    import torch.fx.experimental._config as fx_config

    before = fx_config.backed_size_oblivious
    with size_oblivious():
        assert fx_config.backed_size_oblivious is True
    assert fx_config.backed_size_oblivious == before


def _fake_failures(monkeypatch):
    from torch._dynamo import utils as dynamo_utils

    failures: dict = {}
    monkeypatch.setattr(dynamo_utils, "guard_failures", failures)
    return failures


def _code(name: str) -> types.CodeType:
    ns: dict = {}
    exec(f"def {name}():\n    pass\n", ns)
    return ns[name].__code__


def test_guard_failures_are_per_reader_and_skip_what_happened_before_it(monkeypatch):
    failures = _fake_failures(monkeypatch)
    code = _code("step")
    failures[code] = ["old reason"]
    first = GuardFailures()
    failures[code].append("x.size()[0] != 1")
    second = GuardFailures()  # made after both: sees neither
    assert first.new() == [(code, "x.size()[0] != 1")]
    assert first.new() == []  # each failure once
    assert second.new() == []
    other = _code("other")
    failures[other] = ["a", "b"]
    assert [r for _, r in second.new()] == ["a", "b"]
    assert [r for _, r in first.new()] == ["a", "b"]  # readers do not share counters


def test_guard_failures_key_on_the_code_object_not_its_reusable_id(monkeypatch):
    failures = _fake_failures(monkeypatch)
    reader = GuardFailures()
    a = _code("a")
    failures[a] = ["one"]
    assert len(reader.new()) == 1
    b = _code("b")  # a different code object: its first failure is new
    failures[b] = ["two"]
    assert reader.new() == [(b, "two")]


def test_code_site_names_file_line_and_function():
    code = _code("decode")
    assert code_site(code) == f"{code.co_filename}:{code.co_firstlineno} (decode)"


def test_storage_alias_is_feature_detected():
    assert _torch_compat.HAS_STORAGE_ALIAS is hasattr(
        torch._C, "_construct_storage_from_data_pointer"
    )
