"""The stream operations an :class:`~graphguard.AuxStream` fork/join is made of.

A separate idea from the fork/join policy (:mod:`graphguard.streams`): the policy decides
*whether* a branch overlaps; these operations do it. :class:`StreamBackend` exists so the
ordering of events, waits and allocator bookkeeping can be tested without a GPU (pass a
fake as ``AuxStream(backend=...)``), and so another stream API could be plugged in.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class StreamBackend(Protocol):
    """The stream operations a fork/join needs; the default is :class:`CudaStreamBackend`."""

    def available(self, device: torch.device) -> bool:
        """Whether real streams exist for ``device`` (else the branch runs inline)."""
        ...

    def current_stream(self, device: torch.device) -> Any:
        """The stream the caller is issuing work on (the capture stream while capturing)."""
        ...

    def new_stream(self, device: torch.device, priority: int) -> Any:
        """A fresh side stream."""
        ...

    def record_event(self, stream: Any) -> Any:
        """Record a new event on ``stream`` and return it."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make future work on ``stream`` wait for ``event``."""
        ...

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` the current stream for the block."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator ``tensor`` is also used on ``stream``."""
        ...


class CudaStreamBackend:
    """:class:`StreamBackend` over ``torch.cuda``; every call is legal during graph capture.

    Events recorded on one capturing stream and waited on by another are how CUDA
    graphs learn about cross-stream dependencies, so the same code produces a
    correctly forked-and-joined graph when captured.
    """

    def available(self, device: torch.device) -> bool:
        """CUDA streams exist only for CUDA devices on a machine with CUDA."""
        return device.type == "cuda" and torch.cuda.is_available()

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The current stream of ``device`` (the capture stream inside ``torch.cuda.graph``)."""
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device, priority: int) -> torch.cuda.Stream:
        """A new side stream on ``device``."""
        return torch.cuda.Stream(device=device, priority=priority)  # type: ignore[no-untyped-call]

    def record_event(self, stream: Any) -> Any:
        """Record a fresh event on ``stream`` (allowed while capturing)."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        """Device-side wait; the host never blocks (allowed while capturing)."""
        stream.wait_event(event)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """``torch.cuda.stream`` also switches the current device to the stream's."""
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``Tensor.record_stream``; under capture the allocator defers its events."""
        tensor.record_stream(stream)


__all__ = ["CudaStreamBackend", "StreamBackend"]
