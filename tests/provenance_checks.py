"""What eager reads against what the graphs read: the coverage checks of graph provenance.

Shared by tests/test_provenance_coverage.py (CPU, ``RecordingBackend``) and
tests/gpu/test_provenance_gpu.py (CUDA graphs read through ``cuda-bindings``). What eager
reads is measured independently of graphguard: a dispatch-mode tracer records the storage
of every tensor an eager forward's ops take. Every check prints what it compared, so a
failure is diagnosable from the log alone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphguard as gg


class EagerReads(TorchDispatchMode):
    """Every storage an eager forward's ops take, except ops whose name contains one of
    ``skip`` (a split op runs eagerly between PIECEWISE graphs: its arguments are not the
    graphs' to read); ``device``: only tensors on that device type (None: all)."""

    def __init__(self, skip: tuple[str, ...] = (), device: str | None = None) -> None:
        super().__init__()
        self.skip = skip
        self.device = device
        self.ptrs: set[int] = set()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if not any(s in str(func) for s in self.skip):
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and (
                    self.device is None or t.device.type == self.device
                ):
                    self.ptrs.add(int(t.untyped_storage().data_ptr()))
        return func(*args, **kwargs)


def named_storages(module: torch.nn.Module) -> dict[int, list[str]]:
    """Storage address -> every name of a parameter or buffer that lives there (tied and
    shared names included)."""
    out: dict[int, list[str]] = {}
    tensors = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, t in tensors:
        ptr = int(t.untyped_storage().data_ptr())
        if ptr:
            out.setdefault(ptr, []).append(name)
    return out


def named_reads(model: torch.nn.Module, ptrs: set[int]) -> set[str]:
    """The parameter and buffer names whose storage is among ``ptrs``."""
    return {n for ptr, names in named_storages(model).items() if ptr in ptrs for n in names}


def graph_names(audit: Any) -> set[str]:
    return {x.name for g in audit.graphs for x in g.reads}


def tensor_attrs(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """Tensors an object holds as attributes (one level into lists and tuples): the
    usual suspects for a graph's unknown words (a wrapper's cached aranges and masks)."""
    found: list[tuple[str, torch.Tensor]] = []
    for attr, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            found.append((f"{prefix}.{attr}", v))
        elif isinstance(v, (list, tuple)):
            found += [(f"{prefix}.{attr}[{i}]", x) for i, x in enumerate(v) if torch.is_tensor(x)]
    return found


def explain(address: int, known: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Which of ``known`` holds ``address`` ("?" when none does)."""
    for name, t in known:
        try:
            st = t.untyped_storage()
            start = int(st.data_ptr())
            if start <= address < start + max(int(st.nbytes()), 1):
                return name
        except (RuntimeError, NotImplementedError):
            continue
    return "?"


@dataclass
class Coverage:
    """What one comparison found."""

    label: str
    eager: set[str]
    graphs: set[str]
    missing: set[str]
    unknown: list[str] = field(default_factory=list)
    """One line per unknown word: graph, address, allocation size, kernel, explanation."""

    @property
    def ok(self) -> bool:
        return not self.missing


def coverage(
    label: str,
    model: torch.nn.Module,
    eager_ptrs: set[int],
    audits: Iterable[Any],
    *,
    known: Sequence[tuple[str, torch.Tensor]] = (),
) -> Coverage:
    """Compare by storage address: every parameter or buffer whose storage eager's ops
    took must be the storage of some graph read (names can differ for tied weights).
    Prints each audit table, the comparison and every unknown word (explained by
    ``known`` where it can be)."""
    audits = list(audits)
    by_ptr = named_storages(model)
    read = {r.start for a in audits for g in a.graphs for r in g.reads}
    eager = {ptr for ptr in eager_ptrs if ptr in by_ptr}
    missing = {n for ptr in eager - read for n in by_ptr[ptr]}
    unknown = [
        f"{a.runner} {g.where}: {w.address:#x} ({w.nbytes} B allocation) first taken by "
        f"{w.kernel}: {explain(w.address, known)}"
        for a in audits
        for g in a.graphs
        for w in g.unknown
    ]
    cov = Coverage(
        label,
        eager={n for ptr in eager for n in by_ptr[ptr]},
        graphs={n for a in audits for n in graph_names(a)},
        missing=missing,
        unknown=unknown,
    )
    for a in audits:
        print("\n" + a.table())
    print(
        f"{label}: eager read {len(eager)} named storages ({len(cov.eager)} names); the "
        f"graphs read {len(read & set(by_ptr))} of them; missing {sorted(missing)}"
    )
    shown = sorted(set(unknown))
    print(f"{label}: {len(shown)} unknown word(s) (live, no named owner):")
    for line in shown[:40]:
        print("  " + line)
    return cov


def false_positives(audit: Any, check: Any) -> list[str]:
    """What a correct capture must not report: unowned words, stale reads, moved weights."""
    problems = [
        f"{g.where}: unowned {w.address:#x} by {w.kernel} (last owner {w.last_owner})"
        for g in audit.graphs
        for w in g.unowned
    ]
    problems += [f"stale {n}: {what} ({list(k)[:6]})" for n, what, k in audit.stale]
    if not check.ok:
        problems.append(check.message())
    print(f"{audit.runner}: false positives: {problems or 'none'}")
    return problems


def piece_tensors(runner: Any) -> list[tuple[str, torch.Tensor]]:
    """A PIECEWISE runner's tensors between pieces: each piece's copies of its split-op
    inputs and each piece graph's outputs (on CUDA: views of the pool, without owner)."""
    found: list[tuple[str, torch.Tensor]] = []
    for p in runner.pieces:
        found += [(f"piece {p.index} copy of input {i}", b) for i, b in p._static_bufs.items()]
        for s, e in p._entries.items():
            leaves = torch.utils._pytree.tree_leaves(e.outputs)
            found += [
                (f"piece {p.index} size {s} output {i}", t)
                for i, t in enumerate(leaves)
                if torch.is_tensor(t)
            ]
    return found


def graphed_tensors(g: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors a ``GraphedCausalLM`` holds beside the model (its mask arange and
    constants, the static cache's tensors): the suspects for its graphs' unknown words."""
    return tensor_attrs(g, "g") + [
        (f"cache.layers[{i}].{k}", t)
        for i, layer in enumerate(g.cache.layers)
        for k, t in vars(layer).items()
        if torch.is_tensor(t)
    ]


def moe_block(**kw: Any) -> Any:
    """``bench/archs.py``'s ``MoEBlock``: routed experts on the main stream beside a
    shared expert forked onto a ``gg.AuxStream`` (inline on a CPU)."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from archs import MoEBlock

    return MoEBlock(**kw)


# ------------------------------------------------------------------ the cases
# Each runs on the CPU (RecordingBackend) and on CUDA alike: the CPU suite runs the very
# code the GPU suite runs blind.


def _backend(device: str) -> Any:
    """None on CUDA (the runner's CudaBackend); the CPU emulation otherwise."""
    return None if device == "cuda" else gg.RecordingBackend()


def _eager_device(device: str) -> str | None:
    return "cuda" if device == "cuda" else None


def full_and_piecewise_case(
    model: Any,
    *,
    full_sizes: Sequence[int],
    piecewise_sizes: Sequence[int],
    eager_tokens: int,
    device: str,
    name: str,
) -> None:
    """The reference Llama's ``mixed_step`` through a FULL_AND_PIECEWISE dispatcher with
    ``provenance=True`` and ``sanitize=True`` (the FULL runner's): every size captured;
    the FULL graphs read every parameter and buffer an eager ``mixed_step`` reads, the
    pieces every one it reads outside the attention op (which runs eagerly between them);
    no false positive in either runner."""
    from graphguard_ref.llama import MIXED_ATTENTION_OP
    from graphguard_ref.serving_loop import INPUT_NAMES

    x = model.example_inputs(eager_tokens)
    eager_dev = _eager_device(device)
    whole = EagerReads(device=eager_dev)
    outside = EagerReads(skip=("mixed_attention",), device=eager_dev)
    with torch.inference_mode():
        with whole:
            model.mixed_step(*x)
        with outside:
            model.mixed_step(*x)
    d = gg.build_dispatcher(
        model.mixed_step,
        model.example_inputs(1),
        mode="full_and_piecewise",
        split_ops=[MIXED_ATTENTION_OP],
        max_tokens=max(piecewise_sizes),
        full_sizes=list(full_sizes),
        piecewise_sizes=list(piecewise_sizes),
        fill_values=model.pad_fill_values(),
        names=INPUT_NAMES,
        state=[],
        backend_factory=None if device == "cuda" else gg.RecordingBackend,
        provenance=True,
        sanitize=True,  # the FULL runner's: the pieces are never sanitized
        progress=False,
        name=name,
        options=gg.CaptureOptions(weights=model),
    )
    try:
        with torch.inference_mode():
            reports = d.capture()
        for kind, rep in reports.items():
            print(f"{name} {kind}: {rep.summary()}")
        assert all(rep.failed == [] for rep in reports.values()), {
            k: rep.table() for k, rep in reports.items()
        }
        assert d.full is not None and d.piecewise is not None
        full, pw = d.full.audit(), d.piecewise.audit()
        print(f"{name}: {d.piecewise.describe()}")
        assert type(d.full) is gg.GraphRunner and d.full.sanitize
        assert {g.piece for g in pw.graphs} == set(range(len(d.piecewise.pieces)))
        covered = coverage(f"{name} FULL mixed_step", model, whole.ptrs, [full])
        pieces = coverage(
            f"{name} PIECEWISE (outside attention)",
            model,
            outside.ptrs,
            [pw],
            known=piece_tensors(d.piecewise),
        )
        checks = d.check_weights()
        wrong = false_positives(full, checks["full"]) + false_positives(pw, checks["piecewise"])
        assert covered.ok and pieces.ok and wrong == [], (covered.missing, pieces.missing, wrong)
    finally:
        d.release()


def hf_case(family: str, *, device: str, max_batch: int, cache_len: int) -> None:
    """A tiny Hugging Face ``family`` through ``GraphedCausalLM(provenance=True,
    sanitize=True)``: every size captured; the graphs read every parameter and buffer an
    eager decode step (``g.eager_step``, the same call the graphs were captured from)
    reads; unknown words listed and explained; no false positive."""
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    model = F.model(family, device=device)
    g = GraphedCausalLM(
        model,
        max_batch=max_batch,
        max_cache_len=cache_len,
        backend=_backend(device),
        provenance=True,
        sanitize=True,
        progress=False,
    )
    try:
        report = g.capture()
        print(f"{family}: {report.summary()}")
        assert type(g.runner) is gg.GraphRunner and g.runner.sanitize
        assert report.failed == [] and g.captured_sizes[-1] == max_batch, report.table()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 100, (max_batch, 1), generator=gen).to(device)
        pos = torch.full((max_batch, 1), 5, device=device)
        valid = torch.ones(max_batch, cache_len, dtype=torch.bool, device=device)
        tracer = EagerReads(device=_eager_device(device))
        with g.cache_restored(), tracer:
            g.eager_step(ids, pos, valid)
        audit = g.runner.audit()
        cov = coverage(
            f"{family} GraphedCausalLM", model, tracer.ptrs, [audit], known=graphed_tensors(g)
        )
        wrong = false_positives(audit, g.check_weights())
        assert cov.ok and len(cov.eager) > 10 and wrong == [], (cov.missing, wrong)
    finally:
        g.runner.release()


def moe_case(model: Any, *, sizes: Sequence[int], device: str) -> None:
    """``MoEBlock.step`` (its shared expert forked onto an ``AuxStream``) through a
    ``GraphRunner(provenance=True, sanitize=True)``: every size captured; the graphs read
    every parameter an eager step reads, the aux branch's included; no false positive."""
    batch = max(sizes)
    tracer = EagerReads(device=_eager_device(device))
    with torch.no_grad(), tracer:
        model.step(*model.example_inputs(batch))
    r = gg.GraphRunner(
        model.step,
        model.example_inputs(batch),
        sizes=list(sizes),
        fill_values=model.pad_fill_values(),
        backend=_backend(device),
        provenance=True,
        sanitize=True,
        progress=False,
    )
    try:
        with torch.no_grad():
            report = r.capture()
        print(f"MoE: {report.summary()}")
        assert report.failed == [], report.table()
        audit = r.audit()
        cov = coverage("MoE (AuxStream shared expert)", model, tracer.ptrs, [audit])
        wrong = false_positives(audit, r.check_weights())
        shared = {f"s_gate_up.{i}" for i in range(len(model.router))}
        print(f"MoE: the aux branch's weights read by every graph: {sorted(shared)}")
        assert all(shared <= {x.name for x in g.reads} for g in audit.graphs)
        assert cov.ok and wrong == [], (cov.missing, wrong)
    finally:
        r.release()


def mixed_inputs(model: Any, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``tokens`` tokens of the reference model's ``mixed_step``: slot ``t % max_batch``,
    consecutive positions per slot (distinct (slot, position) pairs), random ids."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(tokens)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
    slots = t % cfg.max_batch
    positions = (seed % 8) + t // cfg.max_batch
    return tuple(v.to(model.device) for v in (ids, positions, slots))


def _off(out: torch.Tensor, ref: torch.Tensor) -> tuple[int, float, float]:
    """Logits outside a bf16 tolerance (a few ulps of the largest logit plus a relative
    term, as tests/gpu/test_modes_gpu.py), the largest difference, the scale."""
    diff = (out.float() - ref.float()).abs()
    scale = float(ref.float().abs().max())
    tol = 0.05 * scale + 0.05 * ref.float().abs()
    return int((diff > tol).sum()), float(diff.max()), scale


def piece_recapture_case(model: Any, runner: Any, name: str, token_counts: Sequence[int]) -> None:
    """Part of the issue's "precision": a weight of one layer moves (``.data =`` a new
    storage with new values; the old kept alive, so the stale graphs read valid memory),
    and ``recapture(only_moved=True)`` redoes exactly the one piece per size that reads
    it, counted; every other piece keeps its graph object; replays equal eager again."""
    batches = [mixed_inputs(model, n, seed=n) for n in token_counts]

    def compare(label: str) -> list[tuple[int, int, float, float]]:
        rows = []
        with torch.inference_mode():
            for n, x in zip(token_counts, batches):
                out = runner(*x).clone()
                ref = model.mixed_step(*x)
                rows.append((n, *_off(out, ref)))
        print(f"{label}: (tokens, logits off, max diff, scale) {rows}")
        return rows

    with torch.inference_mode():
        model.reset_cache()
    assert all(bad == 0 for _, bad, _, _ in compare("before the move"))
    audit = runner.audit()
    reading = audit.reading(name)
    pieces = {p for _, p in reading}
    total = len(runner.door.graph_keys)
    print(f"{name} is read by {reading} of {total} piece graphs")
    assert {s for s, _ in reading} == set(runner.captured_sizes) and len(pieces) == 1
    (piece,) = pieces
    before = {(s, p.index): p.graph_at(s) for p in runner.pieces for s in p.captured_sizes}
    w = model.get_parameter(name)
    old = w.data
    try:
        with torch.no_grad():
            w.data = old * 4  # a new storage: the graphs still read the old one
        stale = compare("moved, not recaptured (stale)")
        if w.device.type == "cuda":  # the CPU emulation re-runs the piece on the new .data
            assert any(diff > 1e-2 * scale for _, _, diff, scale in stale), (
                "the graphs did not read the old weight"
            )
        found = runner.check_weights()
        print(found.message()[:600])
        assert [m.name for m in found.moved] == [name] and found.graphs == reading
        report = runner.recapture(reason=f"{name} moved", only_moved=True)
        print(f"recapture: {report.summary()}; graphs {report.recaptured_graphs}")
        assert report.failed == [], report.table()
        assert report.recaptured_graphs == list(reading)
        assert report.graphs_total == total and len(reading) == len(runner.captured_sizes)
        after = {(s, p.index): p.graph_at(s) for p in runner.pieces for s in p.captured_sizes}
        kept = [k for k, g in before.items() if after.get(k) is g]
        print(
            f"kept {len(kept)} of {total} graph objects; replaced {sorted(set(before) - set(kept))}"
        )
        assert sorted(set(before) - set(kept)) == sorted(reading)
        assert all(k[1] != piece for k in kept) and after.keys() == before.keys()
        fixed = compare("recaptured")
        assert all(bad == 0 for _, bad, _, _ in fixed)
        audit = runner.audit()
        wrong = false_positives(audit, runner.check_weights())
        assert wrong == []
    finally:
        with torch.no_grad():
            w.data = old  # the module fixture's model as it was
        with torch.inference_mode():
            model.reset_cache()


# ------------------------------------------------------------------ the field's reload bugs
# Issue 40's eight, each a small model and the reload that goes wrong. Each must be caught
# before the first replay after the reload, naming the graphs (sizes), the tensor and the
# fix; then the fix (a recapture of what moved, or a complete in-place write) serves what
# eager serves. Run on the CPU (RecordingBackend, provenance=True) and on CUDA (provenance
# on by default) by tests/test_provenance_reloads.py and tests/gpu/test_provenance_gpu.py.

RELOAD_SIZES = (1, 2, 4)


class _MoE(torch.nn.Module):
    """A router and two routed experts (``w13``, ``w2`` on an ``experts`` submodule)."""

    def __init__(self, dev: str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = torch.nn.Linear(8, 2).to(dev)
        self.experts = torch.nn.Module()
        self.experts.w13 = torch.nn.Parameter((torch.randn(2, 8, 16, generator=g) * 0.2).to(dev))
        self.experts.w2 = torch.nn.Parameter((torch.randn(2, 16, 8, generator=g) * 0.2).to(dev))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        w13, w2 = self.experts.w13, self.experts.w2
        for e in range(2):
            out = out + gate[:, e : e + 1] * (torch.relu(x @ w13[e]) @ w2[e])
        return out


class _Kernel:
    """A quantized-GEMM wrapper (not a module) holding its workspace (vllm PR #48438)."""

    def __init__(self, dev: str) -> None:
        self.workspace = torch.linspace(0.5, 1.5, 8, device=dev)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.workspace


class _WithKernel(torch.nn.Module):
    def __init__(self, dev: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8).to(dev)
        self.kernel = _Kernel(dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(self.lin(x))


class _Recurrent(torch.nn.Module):
    """A layer reading a recurrent (conv) state buffer that pause/resume re-allocates."""

    def __init__(self, dev: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8).to(dev)
        self.register_buffer("conv_state", torch.linspace(-1, 1, 8, device=dev), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.conv_state


class _Linear(torch.nn.Module):
    def __init__(self, dev: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8).to(dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Fp8(torch.nn.Module):
    """A weight with a per-tensor scale buffer (FP8 style, in float32 here)."""

    def __init__(self, dev: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8, device=dev) * 0.3)
        self.register_buffer("weight_scale", torch.tensor(0.5, device=dev))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight * self.weight_scale)


class _Mla(torch.nn.Module):
    """MLA's absorbed ``W_UV``: a slice of ``kv_b_proj.weight`` made ``.contiguous()`` when
    the weights are processed after loading (a derived tensor no module lists)."""

    def __init__(self, dev: str) -> None:
        super().__init__()
        self.kv_b_proj = torch.nn.Linear(8, 32, bias=False).to(dev)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        w = self.kv_b_proj.weight.detach().view(2, 16, 8)
        self.W_UV = w[:, 8:, :].transpose(1, 2).contiguous()  # [2, 8, 8]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(0) @ self.W_UV).sum(0)


def _rope(table: torch.Tensor) -> Any:
    def rope(x: torch.Tensor) -> torch.Tensor:
        return x * table

    return rope


class _Closure(torch.nn.Module):
    """A helper function kept as an attribute, closing over a table only it holds."""

    def __init__(self, dev: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8).to(dev)
        self.rope = _rope(torch.linspace(0.1, 0.9, 8, device=dev))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rope(self.lin(x))


def _new(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t.shape, generator=g) * 0.3).to(t.device, t.dtype)


def _replace_parameter(m: Any) -> None:
    """vLLM's ``replace_parameter``: a new Parameter object at a new address."""
    new = _new(m.experts.w13, 1)
    m.experts.w13 = torch.nn.Parameter(new, requires_grad=False)


def _workspace(m: Any) -> None:
    m.kernel.workspace = torch.linspace(0.25, 1.75, 8, device=m.kernel.workspace.device)


def _pause_resume(m: Any) -> None:
    """A memory saver's pause/resume (sglang PR #27140): the state re-allocated. The new
    buffer is made while the old one lives, so it never lands on the same block by luck."""
    resumed = m.conv_state.clone()
    del m._buffers["conv_state"]  # pause: the old memory goes back to the allocator
    m.register_buffer("conv_state", resumed, persistent=False)  # resume: a new buffer


def _set_publication(m: Any) -> None:
    """A trainer publishing a new storage into the engine's parameter with ``set_``."""
    with torch.no_grad():
        m.lin.weight.set_(_new(m.lin.weight, 2))


def _fp8_scale(m: Any) -> None:
    m.weight_scale = torch.tensor(0.25, device=m.weight_scale.device)  # re-materialised


def _closure(m: Any) -> None:
    m.rope = _rope(torch.linspace(0.2, 1.8, 8, device=m.lin.weight.device))


@dataclass(frozen=True)
class ReloadBug:
    """One reload bug: the model, the reload, the name that must be reported, and whether
    the reload runs inside ``runner.refit()`` (else it is found by ``check_weights()``)."""

    make: Any
    reload: Any
    named: str
    refit: bool = False
    expect_error: type = gg.errors.WeightsMovedError


def _experts_never_written(m: Any) -> None:
    """A loader syncing every weight but the routed experts (ROCm/ATOM PR #2028)."""
    with torch.no_grad():
        m.router.weight.copy_(_new(m.router.weight, 3))
        m.router.bias.copy_(_new(m.router.bias, 4))


def _mla_reload(m: Any) -> None:
    with torch.no_grad():
        m.kv_b_proj.weight.copy_(_new(m.kv_b_proj.weight, 5))
    m.process_weights_after_loading()  # W_UV made again, at a new address


RELOAD_BUGS: dict[str, ReloadBug] = {
    "moe_replace_parameter": ReloadBug(_MoE, _replace_parameter, "experts.w13"),
    "kernel_workspace_reallocated": ReloadBug(_WithKernel, _workspace, "kernel.workspace"),
    "recurrent_state_pause_resume": ReloadBug(_Recurrent, _pause_resume, "conv_state"),
    "set_publication_after_capture": ReloadBug(_Linear, _set_publication, "lin.weight"),
    "routed_experts_never_written": ReloadBug(
        _MoE, _experts_never_written, "experts.w13", True, gg.errors.StaleWeightsError
    ),
    "fp8_scale_rematerialised": ReloadBug(_Fp8, _fp8_scale, "weight_scale"),
    "mla_w_uv_contiguous_at_load": ReloadBug(_Mla, _mla_reload, "W_UV", refit=True),
    "tensor_held_by_a_closure": ReloadBug(_Closure, _closure, "rope.<table>"),
}


def reload_case(bug: str, device: str) -> None:
    """Capture a small model, run the bug's reload, and require it caught before any
    replay: the error names the tensor, the graphs (sizes 1, 2, 4) and the fix. Then the
    fix: what moved recaptured (or every weight written) and replays equal eager."""
    case = RELOAD_BUGS[bug]
    model = case.make(device).eval()
    r = gg.GraphRunner(
        model,
        (torch.zeros(4, 8, device=device),),
        sizes=list(RELOAD_SIZES),
        backend=_backend(device),
        provenance=True if device != "cuda" else None,  # CUDA: on by default
        progress=False,
        name=bug,
    )
    with torch.no_grad():
        r.capture()
        print(f"\n{r.audit()}")
        assert r.audit().enabled and r.check_weights().ok, "a false positive right after capture"
        replays = r._store.counters.calls(r._store.entries)
        if case.refit:
            with pytest_raises(case.expect_error) as err, r.refit():
                case.reload(model)
        else:
            case.reload(model)
            found = r.check_weights()
            with pytest_raises(case.expect_error) as err:
                found.raise_if_moved()
        text = str(err.value)
        print(f"{bug}: {text}")
        assert case.named in err.value.names, (case.named, err.value.names)
        assert "1, 2, 4" in text or "size 1,2,4" in text, text  # the graphs, by size
        assert "To fix" in text or "recapture" in text, text  # and the fix
        assert r._store.counters.calls(r._store.entries) == replays  # before any replay
        if case.expect_error is gg.errors.StaleWeightsError:  # the fix: write them all
            with r.refit():
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(_new(p, 6))
        else:
            r.recapture(reason=f"{bug}: reloaded", only_moved=True)
        assert r.check_weights().ok
        for n in (1, 3, 4):
            x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n)).to(device)
            torch.testing.assert_close(r(x), model(x), rtol=1e-4, atol=1e-4)
    r.release()


def pytest_raises(error: type) -> Any:
    import pytest

    return pytest.raises(error)
