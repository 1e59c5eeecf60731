"""Provenance coverage on the CPU (issue 30): every parameter and buffer that eager's
forward reads (measured independently, with a dispatch-mode tracer) appears in the
emulated graphs' reads (``RecordingBackend`` with ``provenance=True``), and a correct
capture under ``sanitize=True`` reports nothing: no size refused, no unowned word, no
stale read, ``check_weights().ok``.

The same checks as tests/gpu/test_provenance_gpu.py, on what the CPU emulation can run:
the reference Llama step (tiny preset) in FULL and FULL_AND_PIECEWISE, three Hugging Face
families through ``GraphedCausalLM``, and an MoE whose shared expert forks onto an
``AuxStream`` (inline on a CPU). Each test prints the audit tables, the comparison and the
unknown words, explained where a known tensor holds them.
"""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.backend import RecordingBackend
from graphguard.piecewise import PiecewiseRunner
from graphguard_ref.llama import MIXED_ATTENTION_OP, LlamaConfig, LlamaDecodeModel
from tests.provenance_checks import (
    EagerReads,
    coverage,
    false_positives,
    full_and_piecewise_case,
    hf_case,
    moe_block,
    moe_case,
    piece_recapture_case,
)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def llama() -> LlamaDecodeModel:
    return LlamaDecodeModel.random(LlamaConfig.preset("tiny"), device="cpu", seed=0)


@torch.inference_mode()
def test_reference_llama_full_graphs_read_what_eager_reads() -> None:
    model = llama()
    sizes = [1, 2, 4]
    tracer = EagerReads()
    with tracer:
        model.decode_step(*model.example_inputs(4))
    r = gg.GraphRunner(
        model.decode_step,
        model.example_inputs(1),
        sizes=sizes,
        fill_values=model.pad_fill_values(),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        state=[],
        backend=RecordingBackend(),
        provenance=True,
        sanitize=True,
        progress=False,
        options=gg.CaptureOptions(weights=model),
    )
    report = r.capture()
    assert report.failed == [], report.table()
    audit = r.audit()
    cov = coverage("llama FULL decode_step", model, tracer.ptrs, [audit])
    assert cov.ok and len(cov.eager) > 10
    assert false_positives(audit, r.check_weights()) == []


@pytest.mark.compile
def test_reference_llama_full_and_piecewise_graphs_read_what_eager_reads(fresh_dynamo) -> None:
    full_and_piecewise_case(
        llama(),
        full_sizes=[1, 2, 4],
        piecewise_sizes=[2, 4, 8],
        eager_tokens=4,
        device="cpu",
        name="llama-tiny",
    )


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_hf_family_graphs_read_what_eager_reads(family: str) -> None:
    pytest.importorskip("transformers")
    hf_case(family, device="cpu", max_batch=4, cache_len=40)


def test_moe_with_an_aux_stream_graphs_read_what_eager_reads() -> None:
    model = moe_block(
        vocab=101, d=32, experts=4, top_k=2, hidden=16, shared_hidden=32, n_layers=2, max_batch=8
    )
    moe_case(model, sizes=[1, 2, 4, 8], device="cpu")


@pytest.mark.compile
def test_reference_llama_piecewise_recaptures_only_the_piece_that_reads_a_moved_weight(
    fresh_dynamo,
) -> None:
    """The GPU suite's per-piece recapture on the reference model, emulated: the tiny
    preset's 2 layers make 3 pieces; ``layers.1.down_weight`` is read by the last."""
    model = llama()
    r = PiecewiseRunner(
        model.mixed_step,
        model.example_inputs(4),
        split_ops=[MIXED_ATTENTION_OP],
        sizes=[2, 4, 8],
        fill_values=model.pad_fill_values(),
        state=[],
        backend=RecordingBackend(),
        provenance=True,
        progress=False,
        options=gg.CaptureOptions(weights=model),
    )
    with torch.inference_mode():
        r.capture()
    try:
        piece_recapture_case(model, r, "layers.1.down_weight", (1, 2, 3, 4, 6, 8))
    finally:
        r.release()
