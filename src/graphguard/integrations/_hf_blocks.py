"""``compile=True``: one Inductor compile of the decoder block serves every layer and size.

Why not the whole model call: compiling it traces all N layers with a symbolic batch, which
on a Llama-3.2-1B shape took longer (35-40 s, first run) than transformers' own compile of
one static batch shape (23 s). The N blocks are one code object, and dynamo caches compiled
code per code object; with modules inlined (``inline_inbuilt_nn_modules``, torch's default)
each block's parameters are graph inputs, so the code compiled for block 0 serves block k
when nothing the block reads differs between layers ("regional compilation").

The one thing that differs is the cache: attention calls ``cache.update(k, v,
self.layer_idx)``, and ``Cache.update`` indexes its list of layers with that int, which
would specialize the graph per layer. Each block is handed instead a one-layer cache
(:func:`one_layer_cache`: the row view's own class with ``update`` writing the block's
layer and ignoring the index, every other method unchanged); dynamo then never reads
``layer_idx`` and adds no guard on it. The layer's counter is an alias (a view of the same
0-d storage), so a static-address guard on the per-layer counter cannot tell layers apart.

The blocks are the modules of the model's ``_no_split_modules`` classes (transformers' own
name for its repeated unit). Their ``forward`` is an instance attribute only while
:meth:`BlockCompile.active` is entered by the decode step (warmups and captures; CUDA
replays run no Python), so the model is unchanged outside graphguard's calls. Everything
around the blocks (embedding, RoPE tables, final norm, LM head, the mask) runs as eager
kernels inside the same CUDA graph. ``compile="model"`` compiles that whole call instead.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from graphguard.compiled import CompiledStep
from graphguard.errors import ConfigError

logger = logging.getLogger("graphguard")


def _block_forward(block: Any, /, *args: Any, **kwargs: Any) -> Any:
    """What is compiled: the class's own forward of one block (hooks stay outside)."""
    return type(block).forward(block, *args, **kwargs)


def find_blocks(model: Any, layers: int) -> tuple[list[torch.nn.Module], str]:
    """The repeated decoder blocks, in cache-layer order, or why they cannot be compiled
    alone (then ``compile=True`` compiles the whole model call)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        return [], f"{type(model).__name__} declares no decoder block (_no_split_modules)"
    if len(blocks) != layers:
        return [], f"{len(blocks)} {type(blocks[0]).__name__} blocks for {layers} cache layers"
    patched = [type(b).__name__ for b in blocks if "forward" in vars(b)]
    if patched:
        return [], f"a {patched[0]} block has its own forward attribute (a hook or a patch)"
    order = [_layer_index(b) for b in blocks]
    if order != list(range(layers)) and any(i is not None for i in order):
        return [], f"the {type(blocks[0]).__name__} blocks' layer_idx are not 0..{layers - 1}"
    return blocks, ""


def _layer_index(block: torch.nn.Module) -> int | None:
    """The cache layer a block writes (its attention's ``layer_idx``), if it says."""
    for m in block.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int):
            return idx
    return None


class _OneLayer:
    """Mixin of :func:`one_layer_cache`: ``update`` writes this block's layer."""

    _gg_layer: Any

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *a: Any, **kw: Any) -> Any:
        # No offloading or lazily added layers here: build_cache made every layer.
        return self._gg_layer.update(key_states, value_states, *a, **kw)


_ONE_LAYER_CLASSES: dict[type, type] = {}


def one_layer_cache(view: Any, index: int) -> Any:
    """``view`` (a cache of rows ``[0, n)``) whose ``update`` writes layer ``index`` only."""
    cls: Any = _ONE_LAYER_CLASSES.get(type(view))
    if cls is None:
        cls = type(f"OneLayer{type(view).__name__}", (_OneLayer, type(view)), {})
        _ONE_LAYER_CLASSES[type(view)] = cls
    one = cls.__new__(cls)
    one.__dict__.update(vars(view))
    layer = copy.copy(view.layers[index])
    counter = layer.cumulative_length
    layer.cumulative_length = counter.view(counter.shape)  # same storage, no static address
    one._gg_layer = layer
    return one


class BlockCompile:
    """The decoder blocks of ``model`` run through one :class:`CompiledStep` while active.

    ``step.compiles`` is 1 after a capture when every block shares the compiled code;
    each :class:`BlockCompile` compiles its own copy of the code object, so building
    several ``GraphedCausalLM`` does not spend dynamo's per-code recompile limit.
    """

    def __init__(self, model: Any, blocks: list[torch.nn.Module], *, mode: str | None) -> None:
        self.blocks = blocks
        code = _block_forward.__code__.replace()  # a code object (and dynamo cache) of its own
        fn = types.FunctionType(code, _block_forward.__globals__, _block_forward.__name__)
        name = f"{type(model).__name__}.{type(blocks[0]).__name__}"
        self.step = CompiledStep(fn, batch_dims=(), mode=mode, name=name)
        self._views: dict[int, list[Any]] = {}
        self._view: Any = None
        self._rows = 0
        self._forwards = [self._forward(i) for i in range(len(blocks))]

    def _forward(self, index: int) -> Any:
        block = self.blocks[index]

        def forward(*args: Any, **kwargs: Any) -> Any:
            view, n = self._view, self._rows
            one = self._views[n][index]
            args = tuple(one if a is view else a for a in args)
            kwargs = {k: one if v is view else v for k, v in kwargs.items()}
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[0] == n:
                    torch._dynamo.maybe_mark_dynamic(t, 0)  # one compile for every size
            return self.step(block, *args, **kwargs)

        return forward

    @contextlib.contextmanager
    def active(self, view: Any, n: int) -> Iterator[None]:
        """Route every block's call to the compiled code while the model runs on ``view``."""
        if n not in self._views:
            self._views[n] = [one_layer_cache(view, i) for i in range(len(view.layers))]
        self._view, self._rows = view, n
        try:
            for block, forward in zip(self.blocks, self._forwards):
                block.forward = forward  # type: ignore[method-assign]
            yield
        finally:
            for block in self.blocks:
                vars(block).pop("forward", None)
            self._view, self._rows = None, 0


def compiled_decode(
    model: Any, decode: Callable[..., Any], layers: int, compile: bool | str, mode: str | None
) -> tuple[CompiledStep, BlockCompile | None]:
    """What ``GraphedCausalLM(compile=...)`` compiles: the decoder block (``True`` when the
    model has one to compile alone, ``"blocks"``) or the whole ``decode`` call
    (``"model"``, or ``True``'s fallback, logged with the reason)."""
    blocks, why = ([], "") if compile == "model" else find_blocks(model, layers)
    if blocks:
        compiled = BlockCompile(model, blocks, mode=mode)
        return compiled.step, compiled
    if compile == "blocks":
        raise ConfigError(
            f"GraphedCausalLM: compile='blocks' cannot compile the decoder block alone: {why}. "
            "Use compile='model' (the whole model call) or compile=True (which picks that "
            "by itself)"
        )
    if why:
        logger.info("GraphedCausalLM: compile=True compiles the whole model call: %s", why)
    return CompiledStep(decode, mode=mode, name=f"{type(model).__name__}.decode"), None


__all__ = ["BlockCompile", "compiled_decode", "find_blocks", "one_layer_cache"]
