"""Random numbers under graphs: which generators a step draws from, and keeping them like eager.

How torch replays randomness (``torch/cuda/graphs.py``, ``CUDAGraph::replay`` and
``CUDAGeneratorState`` in ATen): a captured RNG kernel does not bake a seed and an offset;
it reads them from two small device tensors that belong to the generator's *state*
(shared by every graph that state is registered with). Each ``replay()`` first fills them
with the state's current seed and offset, then advances the offset by what the capture
consumed. So N replays draw what N eager calls draw from the same seed, fresh each replay,
and ``g.manual_seed(s)`` between calls works like eager -- but only for generators
registered with the graph *before* ``capture_begin``. torch registers the default CUDA
generator itself; any other ``torch.Generator`` the step draws from makes the capture fail
("Attempt to increase offset for a CUDA generator not in capture mode").

graphguard therefore registers, with every graph of a ladder: the device's default
generator, every generator named in ``generators=[...]``, and every generator reachable
from the callable (a module attribute ``self.gen``, a closure variable, a global the
function names, a ``functools.partial`` argument; found by the same walker that names
state, :func:`graphguard.walk.reachable_tensors`). Capture restores each of them to the
seed and offset it had before the ``before_capture`` hooks (warmups draw too), so
capture consumes no randomness; ``verify()`` runs graph and eager from the same states.

States are saved with ``get_state()`` and put back with ``set_state()``, which copy the
seed and offset *into* the generator's current state. ``graphsafe_set_state`` would swap
the state object instead and detach the generator from the graphs it is registered with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphguard.errors import CaptureUnsafeOpError, ConfigError, GraphGuardError
from graphguard.walk import reachable_tensors

logger = logging.getLogger("graphguard")


def default_generator(device: torch.device | str) -> torch.Generator | None:
    """The default generator of ``device`` (CUDA: that device's; CPU: the global one)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.default_generator
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= len(torch.cuda.default_generators):
            torch.cuda.init()  # type: ignore[no-untyped-call]  # fills the tuple (lazy init)
        return torch.cuda.default_generators[index]
    return None


def is_default(gen: torch.Generator) -> bool:
    """Whether ``gen`` is its device's default generator (CUDA's ``capture_begin``
    registers that one with every graph itself)."""
    return gen is default_generator(gen.device)


def _same_device(gen: torch.Generator, device: torch.device) -> bool:
    gd = gen.device
    if gd.type != device.type:
        return False
    if gd.type != "cuda":
        return True
    want = device.index if device.index is not None else torch.cuda.current_device()
    have = gd.index if gd.index is not None else torch.cuda.current_device()
    return bool(want == have)


def step_generators(
    fn: Any, declared: Sequence[torch.Generator], device: torch.device | str
) -> list[tuple[str, torch.Generator]]:
    """``(name, generator)`` for every generator a step on ``device`` may draw from.

    In order: the device's default generator (``default``), the declared ones
    (``generators[i]``), then those reachable from ``fn`` (named by the path the walker
    took, e.g. ``sampler.gen``); each generator once. A declared generator on another
    device is a :class:`ConfigError` (a graph on ``device`` cannot replay it); a found one
    on another device is left out (a model may keep a CPU generator for host-side work).
    """
    dev = torch.device(device)
    out: list[tuple[str, torch.Generator]] = []
    seen: set[int] = set()

    def add(name: str, gen: torch.Generator) -> None:
        if id(gen) not in seen:
            seen.add(id(gen))
            out.append((name, gen))

    default = default_generator(dev)
    if default is not None:
        add("default", default)
    for i, gen in enumerate(declared):
        if not _same_device(gen, dev):
            raise ConfigError(
                f"generators[{i}] is a torch.Generator on {gen.device}, but the step runs on "
                f"{dev}: a graph replays only generators of its own device. Pass "
                "options=graphguard.CaptureOptions(generators=[torch.Generator("
                f"device={str(dev)!r}), ...]), or leave this one out."
            )
        add(f"generators[{i}]", gen)
    try:
        found = reachable_tensors(fn, kind=torch.Generator)
    except Exception as err:  # finding is best effort; generators= is the explicit way
        logger.debug("could not walk %r for generators (%s)", fn, err)
        found = []
    for name, gen in found:
        if isinstance(gen, torch.Generator) and _same_device(gen, dev):
            add(name, gen)
    return out


class GeneratorStates:
    """The seed and offset of each generator, to put back later (host only, no sync)."""

    __slots__ = ("_saved",)

    def __init__(self, generators: Sequence[torch.Generator]) -> None:
        self._saved = [(g, g.get_state()) for g in generators]

    def restore(self) -> None:
        """Put every generator back where it was (into its current, registered state)."""
        for g, state in self._saved:
            g.set_state(state)

    def __len__(self) -> int:
        return len(self._saved)


class ReseedCheck:
    """Catches a step that reseeds or rewinds a CUDA generator, at its uncaptured warmups.

    Eagerly such a step draws the same numbers on every call. A graph cannot replay a
    host-side reseed (torch 2.11 even lets ``manual_seed(s)`` with the generator's own
    seed pass silently during capture), so its replays would draw fresh numbers instead:
    a silent difference from eager, refused here. Each generator's offset is first moved
    far ahead (capture restores it afterwards), so a step that reseeds to the very seed
    the caller set still shows: after its warmup the seed changed or the offset went back.
    Only CUDA generators (a CPU generator's state has no offset).
    """

    _AHEAD = 1 << 40  # a multiple of 4, as philox offsets must be

    def __init__(self, named: Sequence[tuple[str, torch.Generator]]) -> None:
        self._named = [(n, g) for n, g in named if g.device.type == "cuda"]
        for _, g in self._named:
            g.set_offset(g.get_offset() + self._AHEAD)
        self._start = self._positions()

    def _positions(self) -> list[tuple[int, int]]:
        return [(g.initial_seed(), g.get_offset()) for _, g in self._named]

    def check(self, where: str) -> None:
        """After one warmup: raise naming the generator it reseeded or rewound."""
        now = self._positions()
        for (name, _), (seed0, off0), (seed, off) in zip(self._named, self._start, now):
            if seed != seed0 or off < off0:
                raise GraphGuardError(
                    f"{where}: the step reseeded or rewound generator {name!r} (seed {seed0} "
                    f"-> {seed}, offset {off0} -> {off}): it calls manual_seed, seed(), "
                    "set_state or torch.manual_seed while it runs, so eagerly it draws the "
                    "same numbers every call, which a graph cannot replay"
                )
        self._start = now


# Text of torch's RNG errors inside a capture (CUDAGeneratorImpl.cpp), lower case.
_UNREGISTERED = (
    "increase offset for a cuda generator not in capture mode",
    "offset increment outside graph capture",
)
_HOST_SIDE = (
    "reseeded or rewound generator",  # ReseedCheck
    "cudageneratorimpl::set_current_seed",  # manual_seed, torch.manual_seed, set_state
    "cudageneratorimpl::seed",  # seed()
    "cudageneratorimpl::set_offset",
    "cudageneratorimpl::get_offset",  # get_state(), get_offset()
    "cudageneratorimpl::current_seed",  # initial_seed(), get_state()
    "cudageneratorimpl::set_state",
    "construct a new cudageneratorimpl",  # torch.Generator(device="cuda") in the step
)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: set[int] = set()
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def rng_cause(exc: BaseException) -> str | None:
    """Why a failed capture is an RNG problem, with the fix; None when it is not one.

    torch's generator checks run before any CUDA call, so these captures end cleanly;
    their text mentions stream capture, which would otherwise read as a host sync.
    """
    for e in _chain(exc):
        if isinstance(e, CaptureUnsafeOpError):
            return None
        text = str(e).lower()
        if any(m in text for m in _UNREGISTERED):
            return (
                " Cause: random numbers. The step draws from a torch.Generator that is not "
                "registered with the graph. graphguard registers the device's default "
                "generator, the ones passed as generators=[...], and those reachable from "
                "the callable (module attributes, closure variables, globals it names); "
                "pass this one as options=graphguard.CaptureOptions(generators=[g]) (e.g. a "
                "generator built inside a helper or kept under a private _name)."
            )
        if any(m in text for m in _HOST_SIDE):
            return (
                " Cause: random numbers. The step reseeds or reads a generator on the host "
                "(manual_seed, seed(), torch.manual_seed, get_state/set_state, "
                "initial_seed, or builds a torch.Generator) while being captured; a graph "
                "cannot replay host-side RNG calls. Seed outside the step, before calling "
                "the runner: every replay reads the generator's seed and offset when it is "
                "launched, so g.manual_seed(s) between calls works like eager."
            )
    return None


def register_all(graph: Any, generators: Sequence[torch.Generator], where: str) -> None:
    """Register every CUDA generator with ``graph`` (before its ``capture_begin``)."""
    if not generators:
        return
    register: Callable[[torch.Generator], None] | None = getattr(
        graph, "register_generator_state", None
    )
    if register is None:
        raise ConfigError(
            f"{where}: the step draws from {len(generators)} generator(s), but torch "
            f"{torch.__version__} cannot register generators with a CUDA graph "
            "(CUDAGraph.register_generator_state, torch >= 2.4); upgrade torch, or sample "
            "from the default generator (generator=None)"
        )
    for g in generators:
        if g.device.type != "cuda":
            raise ConfigError(
                f"{where}: a CUDA graph can replay only CUDA generators, got one on "
                f"{g.device}; pass torch.Generator(device='cuda') generators"
            )
        register(g)


def rnn_dropout_modules(module: Any) -> list[str]:
    """The cuDNN RNNs of ``module`` that run dropout (train mode, ``dropout > 0``, more
    than one layer, on CUDA, cuDNN enabled): the ones whose graphs read cuDNN's dropout
    state (see :class:`CudnnDropoutStates`)."""
    if not isinstance(module, torch.nn.Module) or not torch.backends.cudnn.enabled:
        return []
    return [
        name or type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.RNNBase)
        and m.training
        and m.dropout > 0
        and m.num_layers > 1
        and any(p.is_cuda for p in m.parameters())
    ]


class CudnnDropoutStates(TorchDispatchMode):
    """Around a capture run of a step with a cuDNN RNN running dropout: every dropout
    state buffer ``_cudnn_rnn`` is handed (its last argument), kept alive in :attr:`held`.

    Why: cuDNN's dropout kernels read and write RNG states in one buffer torch caches per
    device (``get_dropout_state``, ATen's ``cudnn/RNN.cpp``) and re-creates on the next
    train-mode call after any reseed of the device's generator (``manual_seed``,
    ``set_state``, ``set_offset``: the capture lifecycle's own generator restore among
    them, and any the user makes between replays). Under ``torch.cuda.graph`` the graph
    then keeps reading and writing the freed buffer. Holding the buffer the graph took
    keeps that memory the graph's: eager calls move on to torch's new buffer, the graph
    keeps its own (as if it had been captured with its own dropout state), and provenance
    finds the graph's words in a live allocation. Costs one buffer (a few MiB) per
    re-creation; released with the graphs."""

    def __init__(self, held: dict[int, torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.held = held

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten._cudnn_rnn.default and args:
            state = args[-1]
            if isinstance(state, torch.Tensor) and state.numel():
                self.held.setdefault(int(state.untyped_storage().data_ptr()), state)
        return func(*args, **(kwargs or {}))


__all__ = [
    "CudnnDropoutStates",
    "GeneratorStates",
    "ReseedCheck",
    "default_generator",
    "is_default",
    "register_all",
    "rng_cause",
    "rnn_dropout_modules",
    "step_generators",
]
