"""The options API of 0.3 (CPU): each option declared once, the feature objects ``Canary``
and ``Lazy``, the flags one runner reads as its keywords, and the moved names' errors."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
import torch

import graphguard as gg
from graphguard import config
from graphguard.config import CaptureKwargs, CaptureOptions, Lazy
from graphguard.errors import ConfigError


def step(x: torch.Tensor) -> torch.Tensor:
    return x * 2


EX = (torch.zeros(2, 4),)


def full(**kw: typing.Any) -> gg.GraphRunner:
    kw.setdefault("sizes", (1, 2, 4))
    kw.setdefault("progress", False)
    kw.setdefault("backend", gg.RecordingBackend())
    return gg.GraphRunner(step, EX, **kw)


# ----------------------------------------------------------------- declared once


def test_capture_kwargs_lists_the_option_fields_with_their_types() -> None:
    """CaptureKwargs (what mypy checks at call sites) repeats the fields: same names, same
    order, same types; the one difference is lazy's True/False shorthand."""
    fields = typing.get_type_hints(CaptureOptions)
    typed = typing.get_type_hints(CaptureKwargs)
    assert list(typed) == list(config.KEYWORD_OPTIONS)
    assert list(fields) == list(config.OPTION_NAMES)
    assert set(config.KEYWORD_OPTIONS) | set(config.OPTIONS_ONLY) == set(fields)
    assert typed == {k: v for k, v in {**fields, "lazy": Lazy | bool | None}.items() if k in typed}
    assert fields["lazy"] == Lazy | None


def test_defaults_come_from_the_fields_and_fill_what_was_not_set() -> None:
    assert not hasattr(config, "DEFAULTS")
    defaults = CaptureOptions.defaults()
    declared = {
        f.name: f.metadata["default"]
        for f in dataclasses.fields(CaptureOptions)
        if "default" in f.metadata
    }
    assert defaults == declared
    assert defaults["warmup_iters"] == 1 and defaults["capture_error_mode"] == "global"
    assert not {"sizes", "max_size", "names", "state", "name", "canary", "lazy"} & set(defaults)
    gone = {"share_outputs", "sanitize", "capture_now", "graph_memory_budget"}
    assert not gone & set(config.OPTION_NAMES)
    resolved = CaptureOptions(warmup_iters=3).resolved()
    assert resolved.warmup_iters == 3
    for k, v in defaults.items():
        assert k == "warmup_iters" or getattr(resolved, k) == v, k
    lazy = CaptureOptions(lazy=True).resolved()  # type: ignore[arg-type]
    assert lazy.capture_error_mode == "thread_local"


def test_graph_runner_signature_is_the_runner_keywords_then_the_options() -> None:
    params = list(inspect.signature(gg.GraphRunner).parameters)
    head = ["fn", "example_inputs", "mode", "compile", "share_outputs", "sanitize", "options"]
    tail = ["backend", "agreement"]
    assert params[: len(head) + 2] == [*head, *tail]
    assert params[len(head) + 2 :] == list(config.KEYWORD_OPTIONS)
    code = gg.GraphRunner.__init__.__code__  # the literal signature, before option_keywords
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + 1]
    assert names == ("self", *head, *tail, "kwargs")


# ------------------------------------------------------------- the feature objects


def test_canary_and_lazy_live_in_config_and_check_their_keywords() -> None:
    from graphguard import canary

    assert canary.Canary is gg.Canary is config.Canary
    assert gg.Lazy is config.Lazy
    with pytest.raises(
        ConfigError, match=r"Canary: unknown argument\(s\) 'evry' \(did you mean 'every'\?\)"
    ):
        gg.Canary(evry=10)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"did you mean 'capture_now'\?"):
        gg.Lazy(capture_nw=[1])  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"lazy must be a graphguard\.Lazy\(\.\.\.\)"):
        CaptureOptions(lazy="yes")  # type: ignore[arg-type]
    assert gg.Lazy(capture_now=[8, 2], budget=2 << 30) == gg.Lazy((2, 8), 2 << 30)
    with pytest.raises(ConfigError, match=r"budget=2 << 30"):
        gg.Lazy(budget=-1)


def test_lazy_shorthand_and_the_ladder_check() -> None:
    assert CaptureOptions(lazy=True).lazy == Lazy()  # type: ignore[arg-type]
    assert CaptureOptions(lazy=False).lazy is None  # type: ignore[arg-type]
    r = full(lazy=gg.Lazy(capture_now=[2], budget=1 << 30))
    assert r.lazy and r.door.ledger.budget == 1 << 30
    r.capture()
    assert r.captured_sizes == (2,)
    with pytest.raises(
        ConfigError, match=r"GraphRunner\(step\): Lazy\(capture_now=\[3\]\) are not sizes"
    ):
        full(lazy=gg.Lazy(capture_now=[3]))


# ------------------------------------------------------------------- moved names


MOVED = {
    "capture_now": ([2], r"capture_now moved into lazy=graphguard\.Lazy\(capture_now=\[\.\.\.\]\)"),
    "graph_memory_budget": (
        1 << 30,
        r"graph_memory_budget moved into lazy=graphguard\.Lazy\(budget=",
    ),
    "share_outputs": (
        False,
        r"share_outputs left the options in 0\.3: it is a GraphRunner keyword",
    ),
    "sanitize": (True, r"sanitize left the options in 0\.3: it is a GraphRunner keyword"),
}


@pytest.mark.parametrize("name", list(MOVED))
def test_a_moved_option_says_where_it_went(name: str) -> None:
    value, needle = MOVED[name]
    with pytest.raises(ConfigError, match=needle):
        CaptureOptions(**{name: value})
    if name in ("capture_now", "graph_memory_budget"):
        for build in (
            lambda: full(**{name: value}),
            lambda: gg.DistributedGraphRunner(step, EX, **{name: value}),
            lambda: gg.build_dispatcher(step, EX, mode="full", max_tokens=4, **{name: value}),
        ):
            with pytest.raises(ConfigError, match=needle):
                build()
    if name == "share_outputs":  # the pieces always share
        with pytest.raises(ConfigError, match=needle):
            gg.PiecewiseRunner(step, EX, split_ops=["x::y"], share_outputs=False)


# ------------------------------------------------------- flags of the runner that reads them


def test_share_outputs_and_sanitize_are_graph_runner_keywords(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)
    r = full()
    assert r.share_outputs is True and r.sanitize is False
    r = full(share_outputs=False, sanitize=True)
    assert r.share_outputs is False and r.sanitize is True
    assert type(r) is gg.GraphRunner  # the sanitizer is a part, not a subclass
    monkeypatch.setenv("GRAPHGUARD_SANITIZE", "1")
    assert full().sanitize is True
    assert type(full(sanitize=False)) is gg.GraphRunner


def test_build_dispatcher_passes_them_to_the_full_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)

    def build(**kw: typing.Any) -> gg.Dispatcher:
        return gg.build_dispatcher(
            step, EX, mode="full", max_tokens=4, backend_factory=gg.RecordingBackend,
            progress=False, **kw,
        )  # fmt: skip

    d = build()
    assert d.full is not None and d.full.share_outputs and not d.full.sanitize
    d = build(share_outputs=False, sanitize=True)
    assert d.full is not None and not d.full.share_outputs and d.full.sanitize
    with pytest.raises(ConfigError, match="share_outputs must be True or False"):
        build(share_outputs="no")


def test_piecewise_keeps_refusing_sanitize() -> None:
    with pytest.raises(ConfigError, match="PiecewiseRunner: sanitize=True is not supported"):
        gg.PiecewiseRunner(step, EX, split_ops=["x::y"], sanitize=True)


# ------------------------------------------------------------- plain construction


def test_every_options_only_field_says_where_it_is_set_and_no_keyword_does() -> None:
    """The unknown-keyword messages (``graphguard.arguments``, below the options) list the
    options-only fields by name: held here to the fields and the typed keywords."""
    fields = set(config.OPTION_NAMES)
    assert set(config.OPTIONS_ONLY) == {m for m in config.MOVED_OPTIONS if m in fields}
    assert not set(config.KEYWORD_OPTIONS) & set(config.MOVED_OPTIONS)
    opts = CaptureOptions.merge(None, where="w", **dict.fromkeys(config.KEYWORD_OPTIONS))
    assert opts == CaptureOptions()  # every keyword option taken (None: not set)
    for name in config.OPTIONS_ONLY:
        with pytest.raises(ConfigError, match=rf"^w: {name} (moved into|is set through) "):
            CaptureOptions.merge(None, where="w", **{name: None})


def test_a_runner_checks_its_keywords_in_init_with_the_whole_list() -> None:
    """The message names the class called (a subclass's own name), the closest keyword,
    and every keyword the runner takes: its own, then the option keywords."""
    from graphguard.keywords import runner_keywords

    known = runner_keywords(gg.GraphRunner.__init__)
    sig = inspect.signature(gg.GraphRunner).parameters
    assert list(known) == [n for n, p in sig.items() if p.kind is p.KEYWORD_ONLY]
    listed = ", ".join(sorted(known))
    with pytest.raises(ConfigError) as info:
        full(compiel=True)
    assert str(info.value) == (
        "GraphRunner: unknown argument(s) 'compiel' (did you mean 'compile'?); the "
        f"arguments are {listed}"
    )

    class Mine(gg.GraphRunner):
        pass

    with pytest.raises(ConfigError, match=r"^Mine: unknown argument\(s\) 'sizez' \(did you"):
        Mine(step, EX, sizez=[1])


def test_the_keyword_check_comes_first() -> None:
    """Before anything else the runner checks (the distributed runner: before it asks for
    torch.distributed; GraphRunner: before the sanitize flag or the options)."""
    with pytest.raises(ConfigError, match=r"^DistributedGraphRunner: unknown argument\(s\)"):
        gg.DistributedGraphRunner(step, EX, sizez=[1])
    with pytest.raises(ConfigError, match=r"^GraphRunner: unknown argument\(s\) 'foo'"):
        gg.GraphRunner(step, EX, sanitize="no", options={}, foo=1)  # type: ignore[arg-type]


def test_storage_checks_need_the_sanitizer() -> None:
    r = full(sanitize=False)
    for call in (r.check_storages, lambda: r.watched_storages(2)):
        with pytest.raises(ConfigError, match=r"sanitizer, which is off; build the runner "):
            call()


def test_config_reexports_each_name_from_its_module() -> None:
    from graphguard import arguments, keywords, mode, options

    homes = (arguments, keywords, mode, options)
    for name in config.__all__:
        owners = [m for m in homes if name in getattr(m, "__all__", ())]
        assert owners and getattr(config, name) is getattr(owners[0], name), name


def test_the_construction_machinery_of_0_4_is_deprecated() -> None:
    from graphguard import sanitizer

    with pytest.warns(DeprecationWarning, match=r"^graphguard\.config\.KeywordsChecked is"):
        assert config.KeywordsChecked is type
    with pytest.warns(DeprecationWarning, match=r"^graphguard\.sanitizer\.Sanitizing is .* "):
        assert sanitizer.Sanitizing is sanitizer.Sanitizer
    with pytest.warns(DeprecationWarning, match=r"^graphguard\.sanitizer\.sanitizing\(cls\)"):
        assert sanitizer.sanitizing(gg.GraphRunner) is gg.GraphRunner
