"""Device facts for user arguments: parse a ``device=``, and how much memory it has.

Why the memory check: a request larger than the whole device (``sizes=[2**40]``,
``reserve(2**60)``) used to reach the allocator and come back as its raw error, or, on a
CPU with overcommit, be granted and then kill the process while its pages are filled.
Comparing with the device's total memory is one host-side query (no synchronization),
made only on the slow paths that allocate.
"""

from __future__ import annotations

import os

import torch

from graphguard.errors import ConfigError


def parse_device(owner: str, device: torch.device | str | int | None) -> torch.device:
    """``device`` as a :class:`torch.device` (``None``: CUDA when available, else the CPU),
    or a :class:`ConfigError` naming ``owner`` and what it got.

    Raw ``torch.device("bogus")`` errors name neither the argument nor the object.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if isinstance(device, bool):
            raise TypeError("a bool is not a device index")
        dev = torch.device(device)
        count = torch.cuda.device_count() if dev.type == "cuda" else 0
        if dev.index is not None and count and dev.index >= count:
            raise ValueError(f"this machine has {count} CUDA device(s), 0..{count - 1}")
        return dev
    except (RuntimeError, TypeError, ValueError) as exc:
        why = str(exc).splitlines()[0] if exc.args else type(exc).__name__
        if isinstance(exc, TypeError) and not isinstance(device, bool):
            why = f"a {type(device).__name__}, not a string, int or torch.device"
        elif "Expected one of" in why:  # torch lists every device type it knows
            why = "an unknown device type"
        raise ConfigError(
            f"{owner}: device={device!r} is not a torch device ({why:.120}); pass e.g. "
            "'cuda', 'cuda:1', 'cpu' or a torch.device (or leave device=None for CUDA when "
            "present)"
        ) from None


def device_total_bytes(device: torch.device) -> int | None:
    """The device's total memory in bytes (physical RAM for the CPU), or None if unknown."""
    try:
        if device.type == "cuda" and torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError, RuntimeError, AssertionError):
        return None
    return None


def fmt_bytes(n: int) -> str:
    """``n`` bytes as a short human number with the exact count: ``1.5 GiB (1610612736 B)``."""
    units = (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20))
    for unit, scale in units:
        if n >= scale:
            return f"{n / scale:,.1f} {unit} ({n} B)"
    return f"{n} B"


__all__ = ["device_total_bytes", "fmt_bytes", "parse_device"]
