"""Static input buffers, padding fill, input validation and output flattening.

A graph reads its inputs from fixed addresses, so every call copies the caller's
tensors into static buffers allocated once at the largest size. Rows past the real
batch (padding up to the captured size) hold per-input *fill values* chosen to be
harmless (token 0, a scratch KV slot), never stale rows of an earlier, larger batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphguard._device import device_total_bytes, fmt_bytes
from graphguard.errors import ConfigError, GraphGuardError, InputMismatchError
from graphguard.sizes import is_int

logger = logging.getLogger("graphguard")


@dataclass(frozen=True)
class InputSpec:
    """What one positional input of the captured callable must look like."""

    name: str
    dtype: torch.dtype
    device: torch.device
    batch_dim: int
    shape: tuple[int, ...]
    """Full shape with the batch dimension set to 0 (a template)."""
    fill: int | float | bool

    def shape_at(self, n: int) -> torch.Size:
        """The shape this input has at batch size ``n``."""
        s = list(self.shape)
        s[self.batch_dim] = n
        return torch.Size(s)

    def describe(self, n: int | str = "B") -> str:
        dims = [str(d) for d in self.shape]
        dims[self.batch_dim] = str(n)
        return f"{self.dtype} [{', '.join(dims)}] on {self.device}"


def _broadcast(value: Any, count: int, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(
                f"{what}: got {len(value)} values for {count} inputs; pass one value for all "
                f"or exactly {count}"
            )
        return list(value)
    return [value] * count


def check_fill(name: str, dtype: torch.dtype, fill: Any) -> None:
    """Raise :class:`ConfigError` unless ``fill`` is exactly representable in ``dtype``.

    ``torch.full`` would silently truncate 3.7 to 3 for int64 and wrap -1 to 255 for
    uint8: padded rows would then hold a value nobody chose.
    """
    fix = f"pass a fill value representable in {dtype} for {name} (fill_values=[...] per input)"
    if isinstance(fill, torch.Tensor) or not isinstance(fill, (bool, int, float, complex)):
        raise ConfigError(
            f"fill value for {name} is {type(fill).__name__} {fill!r:.60}, not a number; {fix}"
        )
    if dtype == torch.bool:
        if fill not in (0, 1) or isinstance(fill, complex):
            raise ConfigError(
                f"fill value {fill!r} for {name} ({dtype}) is not 0/1/True/False; {fix}"
            )
        return
    if dtype.is_complex:
        return
    if isinstance(fill, complex):
        raise ConfigError(f"fill value {fill!r} for {name} ({dtype}) is complex; {fix}")
    if dtype.is_floating_point:
        if math.isfinite(fill) and abs(fill) > torch.finfo(dtype).max:
            raise ConfigError(
                f"fill value {fill!r} for {name} is outside the range of {dtype} "
                f"(max {torch.finfo(dtype).max:g}); {fix}"
            )
        return
    if isinstance(fill, float) and (not math.isfinite(fill) or not fill.is_integer()):
        raise ConfigError(
            f"fill value {fill!r} for {name} ({dtype}) is not a whole number; it would be "
            f"truncated; {fix}"
        )
    info = torch.iinfo(dtype)
    if not info.min <= int(fill) <= info.max:
        raise ConfigError(
            f"fill value {fill!r} for {name} is outside {dtype}'s range {info.min}..{info.max} "
            f"(it would wrap around); {fix}"
        )


def make_specs(
    example_inputs: Sequence[torch.Tensor],
    *,
    batch_dims: int | Sequence[int] = 0,
    fill_values: int | float | bool | Sequence[int | float | bool] = 0,
    names: Sequence[str] | None = None,
) -> list[InputSpec]:
    """Input specs from example tensors (their batch size does not matter)."""
    if isinstance(example_inputs, torch.Tensor):
        raise ConfigError(
            "example_inputs is a single tensor; pass a list or tuple with one tensor per "
            "positional input, e.g. example_inputs=(x,)"
        )
    if not isinstance(example_inputs, (list, tuple)):
        raise ConfigError(
            f"example_inputs must be a list or tuple of tensors, got "
            f"{type(example_inputs).__name__}; e.g. example_inputs=(x, positions)"
        )
    if not example_inputs:
        raise ConfigError("GraphRunner needs at least one example input tensor")
    count = len(example_inputs)
    if fill_values is None:
        raise ConfigError(
            "fill_values=None: padded rows need a value; pass one number for all inputs or "
            "one per input, e.g. fill_values=0"
        )
    if isinstance(names, str):
        raise ConfigError(f"names={names!r} is one string; pass a list, e.g. names=[{names!r}]")
    dims = _broadcast(batch_dims, count, "batch_dims")
    fills = _broadcast(fill_values, count, "fill_values")
    labels = list(names) if names is not None else [f"input[{i}]" for i in range(count)]
    if len(labels) != count:
        raise ConfigError(f"names: got {len(labels)} names for {count} inputs; pass {count}")
    bad_names = [n for n in labels if not isinstance(n, str) or not n]
    if bad_names:
        raise ConfigError(f"names must be non-empty strings, got {bad_names!r}")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"names must be distinct (they label errors), got {labels}")
    specs = []
    for i, (x, d, f, name) in enumerate(zip(example_inputs, dims, fills, labels)):
        if not isinstance(x, torch.Tensor):
            raise ConfigError(
                f"example input {name} is a {type(x).__name__}, not a tensor; every "
                "positional input of the captured callable must be a tensor"
            )
        if x.layout != torch.strided or x.is_nested:
            raise ConfigError(
                f"example input {name} has layout {'nested' if x.is_nested else x.layout}; "
                "graph inputs must be dense (strided) tensors: pass x.to_dense() (a nested "
                "tensor: pad it, e.g. x.to_padded_tensor(0))"
            )
        if x.is_quantized:
            raise ConfigError(
                f"example input {name} is quantized ({x.dtype}); padded rows cannot be filled "
                "in it. Pass its integer values (x.int_repr()) and apply the scale inside the "
                "step"
            )
        if x.ndim == 0:
            raise ConfigError(f"example input {name} is a 0-d tensor; it has no batch dimension")
        if not is_int(d):
            raise ConfigError(
                f"batch_dims[{i}] is {type(d).__name__} {d!r}, not an int; e.g. batch_dims=0"
            )
        if not -x.ndim <= d < x.ndim:
            raise ConfigError(
                f"batch_dims[{i}]={d} is out of range for {name} of shape {tuple(x.shape)}"
            )
        check_fill(name, x.dtype, f)
        d %= x.ndim
        shape = list(x.shape)
        shape[d] = 0
        specs.append(InputSpec(name, x.dtype, x.device, d, tuple(shape), f))
    devices = {s.device for s in specs}
    if len(devices) > 1:
        where = ", ".join(f"{s.name} on {s.device}" for s in specs)
        raise ConfigError(
            f"example inputs are on different devices ({where}); a graph runs on one device: "
            "move every input to it"
        )
    return specs


_SMALLER = (
    "Pass smaller capture sizes (sizes=[...], or options=graphguard.CaptureOptions("
    "max_size=N): batches above the largest size still run, eagerly), or free memory "
    "before building the runner."
)


def _sizes_need(specs: Sequence[InputSpec], max_size: int) -> str:
    """What the static buffers at ``max_size`` cost, per input (for the errors)."""
    parts = [
        f"{s.name} {s.describe(max_size)}: "
        + fmt_bytes(math.prod(s.shape_at(max_size)) * s.dtype.itemsize)
        for s in specs
    ]
    return (
        f"sizes: the largest capture size {max_size} needs static input buffers of "
        + "; ".join(parts)
        + " (each held twice: the buffer and its fill-valued twin)"
    )


def _out_of_memory(exc: BaseException) -> bool:
    """Whether an allocation failed for lack of memory (CUDA's error or the CPU's)."""
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
        "can't allocate memory" in str(exc)  # DefaultCPUAllocator
    )


def _check_fits(specs: Sequence[InputSpec], max_size: int) -> None:
    """Refuse static buffers larger than their device's whole memory, before allocating.

    Why: ``sizes=[2**40]`` was the allocator's raw error (or, on a CPU with overcommit,
    granted and then fatal while filled); a ConfigError can say which input and how much.
    """
    need: dict[torch.device, int] = {}
    for s in specs:
        nbytes = 2 * math.prod(s.shape_at(max_size)) * s.dtype.itemsize
        need[s.device] = need.get(s.device, 0) + nbytes
    for device, nbytes in need.items():
        total = device_total_bytes(device)
        if total is not None and nbytes > total:
            raise ConfigError(
                _sizes_need(specs, max_size)
                + f", {fmt_bytes(nbytes)} in all, more than the {fmt_bytes(total)} {device} "
                "has. " + _SMALLER
            )


class StaticInputs:
    """The static buffers at the largest size, plus a fill-valued twin for refilling tails."""

    def __init__(self, specs: Sequence[InputSpec], max_size: int) -> None:
        self.specs = list(specs)
        self.max_size = max_size
        _check_fits(self.specs, max_size)
        # Never inference tensors, even when the runner is built under
        # torch.inference_mode(): their version counters tell whether the callable
        # writes its inputs in place (inference tensors have none).
        with torch.inference_mode(False):
            try:
                self.buffers = [
                    torch.full(s.shape_at(max_size), s.fill, dtype=s.dtype, device=s.device)
                    for s in specs
                ]
                self._fill = [b.clone() for b in self.buffers]
            except (RuntimeError, MemoryError) as exc:
                if not _out_of_memory(exc):
                    raise
                raise ConfigError(
                    _sizes_need(self.specs, max_size)
                    + f"; allocating them failed ({type(exc).__name__}: {str(exc)[:200]}). "
                    + _SMALLER
                ) from exc

    def views(self, n: int) -> list[torch.Tensor]:
        """The first ``n`` rows of every buffer."""
        return [b.narrow(s.batch_dim, 0, n) for b, s in zip(self.buffers, self.specs)]

    def tails(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destination, source) pairs that reset rows ``n..max_size`` to the fill values."""
        k = self.max_size - n
        dsts = [b.narrow(s.batch_dim, n, k) for b, s in zip(self.buffers, self.specs)]
        srcs = [f.narrow(s.batch_dim, n, k) for f, s in zip(self._fill, self.specs)]
        return dsts, srcs

    def reset(self) -> None:
        """Every row back to its fill value (after graphguard's own uncaptured forwards)."""
        dsts, srcs = self.tails(0)
        torch._foreach_copy_(dsts, srcs)


class InputWrites:
    """Which static inputs the callable writes in place, seen over every forward of a capture.

    Two witnesses, because neither sees every write: version counters (no sync, and they
    count during a CUDA capture too, where no kernel runs) miss kernels that write through
    a raw pointer or ``.data``; a contents comparison (uncaptured forwards only) misses a
    write of the values already there. The comparison is a device-side flag read in
    :meth:`written`, after the lifecycle's synchronize and outside any warmup: reading it
    inside one would synchronize the host where the sanitizer forbids it.
    """

    def __init__(self, static: StaticInputs) -> None:
        self.static = static
        self._by_version: set[int] = set()
        self._flags: list[torch.Tensor] = []
        self._logged = False

    def before(self, contents: bool) -> tuple[list[int], list[torch.Tensor] | None]:
        """What a forward is compared against: version counters, and clones of the
        buffers when ``contents`` (an uncaptured forward)."""
        bufs = self.static.buffers
        versions = [int(b._version) for b in bufs]
        return versions, ([b.clone() for b in bufs] if contents else None)

    def after(self, token: tuple[list[int], list[torch.Tensor] | None]) -> None:
        """Record what the forward since :meth:`before` wrote (no host sync)."""
        versions, clones = token
        bufs = self.static.buffers
        self._by_version.update(
            i for i, (b, v) in enumerate(zip(bufs, versions)) if b._version != v
        )
        if clones is not None:
            # Bytes, not values: NaN fill values compare equal to themselves here.
            self._flags.append(
                torch.stack([torch.ne(_bytes(b), _bytes(c)).any() for b, c in zip(bufs, clones)])
            )

    def written(self, where: str) -> list[int]:
        """Indices of the inputs written so far, logged once by name (reads the device
        flags: call it after a synchronize, outside warmups)."""
        found = set(self._by_version)
        for flags in self._flags:
            found.update(i for i, hit in enumerate(flags.tolist()) if hit)
        self._flags = []
        self._by_version = found
        if found and not self._logged:
            self._logged = True
            logger.info(
                "%s: the callable writes its inputs %s in place; each call copies the written "
                "rows back into the caller's tensors, as eager, and refills padded rows",
                where,
                [self.static.specs[i].name for i in sorted(found)],
            )
        return sorted(found)

    def copy_back(self, dsts: list[torch.Tensor], entry: Any, where: str) -> None:
        """Copy the written rows of ``entry`` (a ladder entry) into the caller's ``dsts``."""
        try:
            torch._foreach_copy_(dsts, entry.writeback_srcs)
        except RuntimeError as exc:
            names = [self.static.specs[i].name for i in entry.writeback]
            raise GraphGuardError(
                f"{where}: the callable writes its input(s) {names} in place (seen at "
                "capture), so graphguard copies the written rows back into the tensors you "
                f"passed, as eager would leave them; that copy failed: {exc}. Pass writable "
                "tensors (not inference tensors outside inference_mode, not expanded views)."
            ) from exc


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def input_mismatches(
    inputs: Sequence[Any], specs: Sequence[InputSpec], max_size: int | None = None
) -> list[str]:
    """Every way ``inputs`` differ from ``specs`` (empty when they match)."""
    problems: list[str] = []
    if len(inputs) != len(specs):
        problems.append(
            f"expected {len(specs)} inputs ({', '.join(s.name for s in specs)}), got {len(inputs)}"
        )
    batch: int | None = None
    batch_from = ""
    for x, s in zip(inputs, specs):
        if not isinstance(x, torch.Tensor):
            problems.append(f"{s.name}: expected a tensor {s.describe()}, got {type(x).__name__}")
            continue
        if x.layout != torch.strided or x.is_nested:
            problems.append(
                f"{s.name}: expected a dense (strided) tensor, got layout "
                f"{'nested' if x.is_nested else x.layout}; pass x.to_dense()"
            )
            continue
        if x.dtype != s.dtype:
            problems.append(f"{s.name}: expected dtype {s.dtype}, got {x.dtype}")
        if x.device != s.device:
            problems.append(f"{s.name}: expected device {s.device}, got {x.device}")
        if x.ndim != len(s.shape):
            problems.append(
                f"{s.name}: expected {len(s.shape)} dims {s.describe()}, got shape {tuple(x.shape)}"
            )
            continue
        trailing_ok = all(
            a == b for i, (a, b) in enumerate(zip(x.shape, s.shape)) if i != s.batch_dim
        )
        if not trailing_ok:
            problems.append(f"{s.name}: expected shape {s.describe()}, got {tuple(x.shape)}")
        n = int(x.shape[s.batch_dim])
        if batch is None:
            batch, batch_from = n, s.name
        elif n != batch:
            problems.append(
                f"{s.name}: batch size {n} differs from {batch_from}'s batch size {batch}"
            )
    if batch == 0:
        problems.append("batch size is 0; call with at least one row")
    return problems


def raise_input_mismatch(inputs: Sequence[Any], specs: Sequence[InputSpec], where: str) -> None:
    """Raise :class:`InputMismatchError` listing every mismatch, if there is one."""
    problems = input_mismatches(inputs, specs)
    if problems:
        raise InputMismatchError(
            f"{where}: inputs do not match what the runner was built for:\n  - "
            + "\n  - ".join(problems)
            + "\nPass tensors with the example inputs' dtype, device and trailing shape, "
            "all with the same batch size."
        )


# ----------------------------------------------------------------------------- outputs


def flatten(obj: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``torch.utils._pytree.tree_flatten`` that also understands dataclasses.

    torch's pytree treats an unregistered dataclass as a leaf; output dataclasses
    (e.g. ``DecodeOutput(logits, hidden)``) are registered on first sight so their
    tensor fields get graph-backed storage like any other leaf.
    """
    leaves, spec = pytree.tree_flatten(obj)
    pending = [
        type(leaf)
        for leaf in leaves
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)
    ]
    if pending:
        register = getattr(pytree, "register_dataclass", None)
        if register is None:
            raise ConfigError(
                f"output contains dataclass {pending[0].__name__}, which this torch version's "
                "pytree cannot register; return a tuple or dict of tensors instead"
            )
        for cls in dict.fromkeys(pending):
            register(cls)
        leaves, spec = pytree.tree_flatten(obj)
    return leaves, spec


def unflatten(leaves: Sequence[Any], spec: pytree.TreeSpec) -> Any:
    """Inverse of :func:`flatten`."""
    return pytree.tree_unflatten(list(leaves), spec)


def immutable_structure(spec: pytree.TreeSpec) -> bool:
    """True when the output container can be built once and returned on every call.

    A single tensor, tuples and namedtuples cannot be mutated by the caller; a dict,
    list or dataclass could be, so those are rebuilt (cheaply, from cached views) per call.
    """
    if spec.is_leaf():
        return True
    if spec.type is not tuple and not (
        isinstance(spec.type, type) and issubclass(spec.type, tuple)
    ):
        return False
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    return all(immutable_structure(c) for c in children)


__all__ = [
    "InputSpec",
    "InputWrites",
    "StaticInputs",
    "check_fill",
    "flatten",
    "immutable_structure",
    "input_mismatches",
    "make_specs",
    "raise_input_mismatch",
    "unflatten",
]
