"""Tensor-parallel graphs with NCCL collectives inside.

Most tests run in this process as rank 0 of a 1-rank NCCL group (a file:// store): the
capture path (communicator made before capture, thread-local capture mode, check-ins,
agreement) is the multi-GPU one. A one-rank all-reduce launches no kernel, so the
check that NCCL kernels are inside the graphs spawns 2 ranks (one GPU each; skipped
with fewer than 2 GPUs). 4-GPU runs are ``scripts/run_tp.sh N`` (``bench/bench_tp.py``).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import graphguard as gg
from graphguard.distributed import DistributedGraphRunner
from graphguard_ref.demo import Sequences
from graphguard_ref.demo.tp import free_port
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel
from graphguard_ref.tp import TensorParallelLlama

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def nccl_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[torch.device]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not (dist.is_available() and dist.is_nccl_available()):
        pytest.skip("needs torch.distributed with NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    device = torch.device("cuda", torch.cuda.current_device())
    store = tmp_path_factory.mktemp("nccl") / "store"
    kwargs = {"device_id": device}
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
        **kwargs,
    )
    try:
        yield device
    finally:
        dist.destroy_process_group()


def _model(device: torch.device, dtype: torch.dtype = torch.float32) -> TensorParallelLlama:
    cfg = LlamaConfig.preset("tiny", max_batch=16, max_context=128)
    return TensorParallelLlama.random_sharded(cfg, device=device, dtype=dtype, seed=0)


def _runner(model: TensorParallelLlama) -> DistributedGraphRunner:
    return DistributedGraphRunner(
        model.decode_step,
        model.example_inputs(1),
        sizes=SIZES,
        fill_values=model.pad_fill_values(),
        names=("token_ids", "positions", "slots"),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        timeout=60.0,
    )


def test_tp1_with_a_group_equals_the_plain_model(nccl_world: torch.device) -> None:
    cfg = LlamaConfig.preset("tiny", max_batch=16, max_context=128)
    full = LlamaDecodeModel.random(cfg, device=nccl_world, seed=0)
    tp = _model(nccl_world)
    inp = full.example_inputs(7, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(full.decode_step(*inp), tp.decode_step(*inp))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_equals_eager_over_200_steps_with_transitions(
    nccl_world: torch.device, dtype: torch.dtype
) -> None:
    model = _model(nccl_world, dtype)
    runner = _runner(model)
    assert runner.runner.options.capture_error_mode == "thread_local"
    with torch.inference_mode():
        report = runner.capture()
        assert report.captured == SIZES
        schedule = [b for b in (5, 1, 16, 3, 8, 2, 13, 4) for _ in range(25)]
        seqs = Sequences(16, 128, nccl_world)
        gen = torch.Generator(device=nccl_world).manual_seed(1)
        tokens = torch.randint(0, model.config.vocab_size, (16,), device=nccl_world, generator=gen)
        exact_steps = bitwise = 0
        for b in schedule:
            pos, slots = seqs.step_inputs(b)
            tok = tokens[:b]
            g = runner(tok, pos, slots).clone()
            e = model.decode_step(tok, pos, slots)
            # Same kernels at a captured size: bitwise. Padded: each row's GEMM is the
            # same math at another M; allow rounding, require the same argmax.
            if b in SIZES:
                exact_steps += 1
                assert torch.equal(g, e), f"batch {b}: graph != eager"
            else:
                torch.testing.assert_close(g.float(), e.float(), rtol=0, atol=5e-2)
            bitwise += int(torch.equal(g, e))
            assert torch.equal(g.argmax(-1), e.argmax(-1))
            tokens = torch.cat([g.argmax(-1), tokens[b:]])
        assert len(schedule) == 200 and exact_steps >= 100
    runner.release()


def _nccl_kernels_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the 2-rank check: capture, replay size 4 under the profiler, write
    the CUDA kernel names the replay launched to ``out_dir/rank<N>.json``."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
        device_id=device,
    )
    try:
        model = _model(device)
        runner = _runner(model)
        inp = model.example_inputs(4)
        with torch.inference_mode():
            runner.capture()
            runner(*inp)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner.runner.replay(4)
                torch.cuda.synchronize()
        events = prof.events()
        result = {
            "kernels": [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA],
            "graph_launches": sum("cudaGraphLaunch" in e.name for e in events),
            "layers": model.config.num_layers,
        }
        runner.release()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.process
def test_nccl_kernels_are_inside_the_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one NCCL rank each); a one-rank all-reduce launches no kernel")
    if not (dist.is_available() and dist.is_nccl_available()):
        pytest.skip("needs torch.distributed with NCCL")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
    mp.spawn(_nccl_kernels_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(results):
        assert res["graph_launches"] >= 1, f"rank {rank}: the replay was not a graph launch"
        if not res["kernels"]:
            pytest.skip("the profiler recorded no CUDA kernels of the graph replay (CUPTI)")
        nccl = [n for n in res["kernels"] if "nccl" in n.lower()]
        # Two all-reduces per layer, all inside the one graph launch.
        assert len(nccl) >= 2 * res["layers"], (rank, sorted(set(res["kernels"])))


def test_pad_policy_replays_the_agreed_graph(nccl_world: torch.device) -> None:
    model = _model(nccl_world)
    runner = DistributedGraphRunner(
        model.decode_step,
        model.example_inputs(1),
        sizes=SIZES,
        fill_values=model.pad_fill_values(),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        on_mismatch="pad",
    )
    with torch.inference_mode():
        runner.capture()
        inp = model.example_inputs(3)
        assert runner.agree_batch(3) == (3, 3)
        g = runner(*inp).clone()
        e = model.decode_step(*inp)
        torch.testing.assert_close(g, e, rtol=0, atol=1e-4)
    assert isinstance(runner.runner, gg.GraphRunner)
    runner.release()
