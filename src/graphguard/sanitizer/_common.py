"""Shared by the sanitizer's checks: feature detection and small storage helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

POISON: Callable[[int, str], None] | None = getattr(
    torch._C, "_set_storage_data_ptr_access_error_msg", None
)
"""Poisons a storage (CUDAGraph Trees' mechanism); missing on CPU builds."""
FROM_WEAK: Callable[[int], Any] | None = getattr(torch.UntypedStorage, "_new_with_weak_ptr", None)
"""The storage behind a weak reference, to read its current address and size."""


def weak(storage: Any) -> StorageWeakRef:
    """A weak reference to a storage (keeps the StorageImpl object, not its memory)."""
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


def expired(ref: StorageWeakRef) -> bool:
    return bool(ref.expired())  # type: ignore[no-untyped-call]


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    for leaf in pytree.tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for tensors without one (sparse, nested...)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def describe_tensor(t: torch.Tensor) -> str:
    nbytes = t.numel() * t.element_size()
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} ({nbytes} bytes)"


def op_name(func: Any) -> str:
    """``namespace.name`` of an ATen op overload (as shown in sanitizer errors)."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or str(func)
    namespace = getattr(func, "namespace", "aten")
    return f"{namespace}.{name}"
