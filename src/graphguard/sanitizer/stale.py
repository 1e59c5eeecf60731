"""Stale outputs: reading a runner's output after a later replay overwrote it.

Each sanitized call returns fresh tensors aliasing the static output memory through
non-owning storages; at the next replay (or ``release()``) those storages are
poisoned (``torch._C._set_storage_data_ptr_access_error_msg``, the mechanism of
``torch.compile``'s CUDAGraph Trees), so reading an old output raises naming the call
that overwrote it. Where that private API is missing (CPU builds) outputs are a
:class:`GuardedOutput` whose ``__torch_function__`` raises
:class:`~graphguard.errors.StaleOutputError` -- weaker: a raw ``data_ptr``, a NumPy
view or a C extension reaching the memory is not stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from graphguard._torch_compat import HAS_STORAGE_ALIAS, alias_storage, tensor_over
from graphguard.buffers import flatten, unflatten
from graphguard.errors import StaleOutputError
from graphguard.sanitizer._common import POISON, expired, storage, weak


class _CallToken:
    """Shared by the outputs of one call; set stale when a later replay overwrites them."""

    __slots__ = ("message", "ptrs")

    def __init__(self, ptrs: frozenset[int]) -> None:
        self.ptrs = ptrs
        self.message: str | None = None


_METADATA_FUNCS = frozenset(
    {
        "__get__",
        "size",
        "dim",
        "ndimension",
        "stride",
        "numel",
        "nelement",
        "storage_offset",
        "is_contiguous",
        "element_size",
        "is_floating_point",
        "is_complex",
        "__hash__",
        "__len__",
        "__del__",
    }
)


class GuardedOutput(torch.Tensor):
    """Fallback stale-output guard where torch cannot poison storages (e.g. CPU builds).

    A plain tensor subclass sharing the output memory: every torch function on it (and
    on views made from it, which inherit the guard) first checks whether a later replay
    has overwritten the memory, and raises :class:`StaleOutputError` if so. Metadata
    (shape, dtype, strides) stays readable. Weaker than storage poisoning: a raw
    ``data_ptr`` or NumPy view taken before the next call is not stopped.
    """

    _gg_token: _CallToken | None

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        token: _CallToken | None = None
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, GuardedOutput):
                tok = leaf.__dict__.get("_gg_token")
                if tok is not None:
                    name = getattr(func, "__name__", "")
                    if tok.message is not None and name not in _METADATA_FUNCS:
                        raise StaleOutputError(tok.message)
                    token = tok
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if token is None:
                return out
            return pytree.tree_map_only(torch.Tensor, lambda r: _retag(r, token), out)


def _retag(r: torch.Tensor, token: _CallToken) -> torch.Tensor:
    """Views of guarded memory stay guarded; anything else becomes a plain tensor."""
    st = storage(r)
    try:
        aliases = st is not None and st.data_ptr() in token.ptrs
    except RuntimeError:
        aliases = False
    if not aliases:
        return r.as_subclass(torch.Tensor) if type(r) is not torch.Tensor else r
    g = r.as_subclass(GuardedOutput)
    g.__dict__["_gg_token"] = token
    return g


class OutputGuard:
    """The outputs of a runner's latest call, and the poisoning of the previous ones."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._live: list[StorageWeakRef] = []
        self._token: _CallToken | None = None
        self._what = ""

    def invalidate(self, why: str) -> None:
        """Poison the outputs handed out by the previous call (if still held)."""
        if self._token is None and not self._live:
            return
        msg = (
            f"graphguard StaleOutputError: this tensor is an output of {self.owner} "
            f"{self._what}, and {why}, so its contents are overwritten. Runner "
            "outputs are views valid only until the next call: clone what you keep "
            "(out = runner(...).clone()) or build the runner with "
            "options=graphguard.CaptureOptions(copy_outputs=True)."
        )
        if self._token is not None:
            self._token.message = msg
            self._token = None
        if POISON is not None:
            for ref in self._live:
                if not expired(ref):
                    POISON(ref.cdata, msg)
        self._live = []

    def guard(self, out: Any, what: str) -> Any:
        """``out`` re-issued so that the next :meth:`invalidate` makes it unreadable."""
        leaves, spec = flatten(out)
        self._what = what
        if POISON is not None and HAS_STORAGE_ALIAS:
            fresh: dict[int, torch.UntypedStorage] = {}
            new: list[Any] = []
            for leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    new.append(leaf)
                    continue
                st = leaf.untyped_storage()
                ptr = int(st.data_ptr())
                alias = fresh.get(ptr)
                if alias is None:
                    alias = alias_storage(st, leaf.device)
                    fresh[ptr] = alias
                    self._live.append(weak(alias))
                new.append(tensor_over(alias, leaf))
            return unflatten(new, spec)
        ptrs = frozenset(
            int(leaf.untyped_storage().data_ptr())
            for leaf in leaves
            if isinstance(leaf, torch.Tensor)
        )
        token = _CallToken(ptrs)
        self._token = token
        guarded = [
            _retag(leaf, token) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
        ]
        return unflatten(guarded, spec)


__all__ = ["GuardedOutput", "OutputGuard"]
