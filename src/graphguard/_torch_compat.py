"""The one home of what graphguard takes from torch's private or version-dependent APIs.

Why a module of its own: each of these leans on something torch does not promise
(``torch._C`` entry points, dynamo's bookkeeping, an fx config flag that appeared in 2.8),
so when torch changes one of them there is exactly one place to look, feature-detected
here and nowhere else. Capture unwinding, which leans on more of torch, has its own
quarantine (``_unwind.py``).

- :func:`unowned` / :func:`alias_storage` / :func:`tensor_over`: a tensor over another
  tensor's memory that does not own it (``torch._C._construct_storage_from_data_pointer``).
- :func:`size_oblivious`: compile without specializing symbolic sizes on 0 and 1.
- :class:`GuardFailures`: dynamo's guard-failure reasons recorded since a reader was made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

_CONSTRUCT_STORAGE: Callable[[int, torch.device, int], Any] | None = getattr(
    torch._C, "_construct_storage_from_data_pointer", None
)

HAS_STORAGE_ALIAS = _CONSTRUCT_STORAGE is not None
"""Whether this torch build can make a non-owning storage over an address."""


def alias_storage(st: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    """A fresh storage object over ``st``'s memory that does not own (or free) it.

    Poisoning or dropping the alias leaves ``st`` untouched; the memory lives only as
    long as its owner does, so the caller must guarantee the owner outlives every use.
    """
    if _CONSTRUCT_STORAGE is None:  # pragma: no cover - every tested torch has it
        raise RuntimeError(
            "graphguard: this torch build lacks torch._C._construct_storage_from_data_pointer, "
            "needed for non-owning graph outputs; use torch >= 2.4"
        )
    out: torch.UntypedStorage = _CONSTRUCT_STORAGE(int(st.data_ptr()), device, int(st.nbytes()))
    return out


def tensor_over(alias: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A tensor with ``like``'s dtype, offset, shape and strides over ``alias``.

    Made in the caller's inference mode (an inference tensor under
    ``torch.inference_mode()``); wrap the call in ``torch.inference_mode(False)`` for a
    tensor that later non-inference code may use.
    """
    with torch.no_grad():
        out = torch.empty(0, dtype=like.dtype, device=like.device)
        out.set_(alias, like.storage_offset(), like.shape, like.stride())
    return out


def unowned(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory that does not own it (CUDA graph trees and vLLM's
    ``weak_ref_tensors`` hand out graph outputs the same way)."""
    return tensor_over(alias_storage(t.untyped_storage(), t.device), t)


@contextlib.contextmanager
def size_oblivious() -> Iterator[None]:
    """Compile without specializing symbolic sizes on 0 and 1 (torch >= 2.8).

    Without it dynamo assumes a dynamic dimension is at least 2 and guards on that, so a
    batch (or token count) of 1 compiles a second time. ``backed_size_oblivious`` stops
    that, as long as the step itself does not branch on the size: Python on the size
    (``if t == 1``), or a contiguity check (``.reshape`` / ``.contiguous()`` /
    ``.flatten``) of a non-contiguous slice still specializes it. Older torch: a no-op
    (size 1 recompiles, and graphguard counts and logs the recompile).
    """
    try:
        import torch.fx.experimental._config as fx_config
    except ImportError:  # pragma: no cover - very old torch
        yield
        return
    if not hasattr(fx_config, "backed_size_oblivious"):  # pragma: no cover - torch < 2.8
        yield
        return
    with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        yield


def _dynamo_guard_failures() -> dict[Any, list[Any]]:
    """A copy of ``torch._dynamo.utils.guard_failures`` (code object -> reasons), or {}."""
    try:
        from torch._dynamo import utils as dynamo_utils
    except ImportError:  # pragma: no cover - torch without dynamo
        return {}
    failures = getattr(dynamo_utils, "guard_failures", None)
    return {code: list(r) for code, r in failures.items()} if isinstance(failures, dict) else {}


class GuardFailures:
    """Dynamo's guard failures recorded since this reader was made, each seen once.

    Dynamo keeps one process-wide list of reasons per code object. Each compiling
    object (a :class:`~graphguard.compiled.CompiledStep`, a ``PiecewiseCompiler``) owns a
    reader, so failures from before it existed, or read by another reader, are not
    reported as its own. The reader keys on the code objects themselves (holding them,
    as dynamo already does), not on ``id(code)``, whose values are reused once a code
    object is collected.
    """

    def __init__(self) -> None:
        self._seen: dict[Any, int] = {
            code: len(reasons) for code, reasons in _dynamo_guard_failures().items()
        }

    def new(self) -> list[tuple[Any, Any]]:
        """``(code, reason)`` for every failure recorded since the last call."""
        out: list[tuple[Any, Any]] = []
        for code, reasons in _dynamo_guard_failures().items():
            seen = self._seen.get(code, 0)
            out.extend((code, r) for r in reasons[seen:])
            self._seen[code] = len(reasons)
        return out


def code_site(code: Any) -> str:
    """``file:line (function)`` of a code object, as a guard failure is reported."""
    name = getattr(code, "co_name", "?")
    line = getattr(code, "co_firstlineno", "?")
    fname = getattr(code, "co_filename", "?")
    return f"{fname}:{line} ({name})"


__all__ = [
    "HAS_STORAGE_ALIAS",
    "GuardFailures",
    "alias_storage",
    "code_site",
    "size_oblivious",
    "tensor_over",
    "unowned",
]
