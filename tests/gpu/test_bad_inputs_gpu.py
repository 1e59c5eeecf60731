"""Bad inputs on real CUDA memory and streams (issue 20 items 6 and 8): each is a
graphguard error naming the argument, then a good call on the same object equals eager.

The CPU matrix (tests/test_bad_inputs.py) has every case; these are the ones whose
failure on a GPU was different (the CUDA allocator's raw error, a CUDA stream made
mid-capture, a device index that does not exist).
"""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.errors import ConfigError, GraphCaptureError, GraphGuardError, InputMismatchError

from .blocks import TinyBlock

SIZES = [1, 2, 4, 8]


def inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (
        torch.randint(0, 1000, (n,), device="cuda", generator=g),
        torch.rand(n, device="cuda", generator=g) + 0.5,
    )


@pytest.fixture(scope="module")
def block() -> TinyBlock:
    torch.backends.cuda.matmul.allow_tf32 = False
    return TinyBlock().cuda().eval()


@pytest.fixture
def runner(block: TinyBlock):
    r = gg.GraphRunner(block, inputs(2), sizes=SIZES, fill_values=(0, 1.0), progress=False)
    with torch.inference_mode():
        r.capture()
    yield r
    r.release()


def total_bytes() -> int:
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


@torch.inference_mode()
def test_replay_true_is_refused_and_replay_1_equals_eager(runner, block) -> None:
    with pytest.raises(ConfigError, match=r"replay\(n\) takes a batch size.*bool True"):
        runner.replay(True)
    with pytest.raises(ConfigError, match=r"static_inputs\(n\).*bool True"):
        runner.static_inputs(True)
    x = inputs(1, seed=3)
    for view, src in zip(runner.static_inputs(1), x):
        view.copy_(src)
    out = runner.replay(1)
    assert torch.equal(out, block(*x))


def test_workspace_larger_than_the_gpu_is_a_config_error() -> None:
    ws = gg.Workspace("gpu-scratch", "cuda")
    (a,) = ws.get(((1024,), torch.float16))
    total = total_bytes()
    with pytest.raises(ConfigError) as info:
        ws.reserve(2**60)
    msg = str(info.value)
    assert "Workspace 'gpu-scratch'" in msg and "1152921504606846976 B" in msg
    assert f"({total} B) cuda has in all" in msg
    with pytest.raises(ConfigError, match="can never hold it"):
        ws.get(((2**40, 2**10), torch.bfloat16))
    (b,) = ws.get(((1024,), torch.float16))  # the arena is whole: same buffer
    assert b.data_ptr() == a.data_ptr() and ws.growths == 1


def test_workspace_that_fits_the_gpu_but_not_free_memory_stays_an_oom() -> None:
    """Engines catch torch.OutOfMemoryError to size their KV cache: a request the device
    could hold but its free memory cannot stays that error, with graphguard's note."""
    ws = gg.Workspace("almost-all", "cuda")
    (a,) = ws.get(((256,), torch.float32))
    torch.cuda.empty_cache()  # cached blocks would be freed and retried by the allocator
    free, total = torch.cuda.mem_get_info()
    request = free + (total - free) // 2  # more than is free, less than the device has
    assert free < request < total_bytes() - (1 << 20)
    with pytest.raises(torch.OutOfMemoryError) as info:
        ws.reserve(request)
    notes = " ".join(getattr(info.value, "__notes__", []))
    if hasattr(info.value, "add_note"):
        assert "workspace arena 'almost-all'" in notes
    assert ws.nbytes == 1024 and ws.peak_bytes == 1024
    (b,) = ws.get(((256,), torch.float32))
    assert b.data_ptr() == a.data_ptr()
    torch.cuda.empty_cache()


def test_sizes_too_large_for_the_gpu_name_the_bytes_per_input(block) -> None:
    with pytest.raises(ConfigError) as info:
        gg.GraphRunner(block, inputs(2), sizes=[2**40], fill_values=(0, 1.0), progress=False)
    msg = str(info.value)
    assert "largest capture size 1099511627776" in msg
    assert "input[0] torch.int64 [1099511627776] on cuda:0: 8.0 TiB" in msg
    assert "input[1] torch.float32 [1099511627776] on cuda:0: 4.0 TiB" in msg
    assert "Pass smaller capture sizes" in msg
    r = gg.GraphRunner(block, inputs(2), sizes=[1, 2], fill_values=(0, 1.0), progress=False)
    with torch.inference_mode():
        r.capture()
        x = inputs(2, seed=1)
        got = r(*x)  # a captured size: bitwise
        assert torch.equal(got, block(*x))
    r.release()


@torch.inference_mode()
def test_sparse_call_is_an_input_mismatch(runner, block) -> None:
    tokens, scale = inputs(3)
    with pytest.raises(InputMismatchError, match=r"input\[1\]: expected a dense .*sparse_coo"):
        runner(tokens, scale.to_sparse())
    tokens, scale = inputs(4)  # a captured size: bitwise (3 rows would replay size 4)
    got = runner(tokens, scale)
    assert torch.equal(got, block(tokens, scale))


@torch.inference_mode()
def test_released_runner_says_so_and_captures_again(block) -> None:
    r = gg.GraphRunner(block, inputs(2), sizes=SIZES, fill_values=(0, 1.0), progress=False)
    r.capture()
    r.release()
    x = inputs(4, seed=2)  # a captured size: bitwise below
    with pytest.raises(GraphGuardError, match=r"after release\(\).*runner\.capture\(\)"):
        r(*x)
    r.capture()
    got = r(*x)
    assert torch.equal(got, block(*x))
    r.release()


def test_auxstream_device_index_that_does_not_exist() -> None:
    bad = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ConfigError, match=r"is not a torch device \(this machine has \d+ CUDA"):
        gg.AuxStream("rope", device=bad)
    with pytest.raises(ConfigError, match="CUDA device"):
        gg.Workspace("w", bad)
    aux = gg.AuxStream("rope", device="cuda:0")
    assert aux.device == torch.device("cuda:0")


@torch.inference_mode()
def test_fork_of_a_non_tensor_fails_in_the_warmup_not_mid_capture() -> None:
    """The bad fork is refused in the first (inline) warmup, before any capture began, so
    no CUDA capture is invalidated; the same step with tensors forks and equals eager."""
    w = torch.randn(64, 64, device="cuda")
    aux = gg.AuxStream("side")
    extra: list[object] = [5]

    def step(x: torch.Tensor) -> torch.Tensor:
        with aux.fork(x, *extra) as br:  # type: ignore[arg-type]
            y = torch.tanh(x @ w)
            br.keep(y)
            with br.on_main():
                z = x * 2
        return y + z

    def make() -> gg.GraphRunner:
        return gg.GraphRunner(
            step, (torch.zeros(1, 64, device="cuda"),), sizes=[1, 4], progress=False
        )

    r = make()
    with pytest.raises(GraphCaptureError) as info:
        r.capture()
    assert isinstance(info.value.cause, ConfigError)
    assert "AuxStream 'side': fork(*tensors): argument 1 is int 5" in str(info.value)
    assert r.captured_sizes == ()
    extra.clear()
    good = make()
    good.capture()
    for n in (1, 3, 4):
        x = torch.randn(n, 64, device="cuda")
        torch.testing.assert_close(good(x), step(x))
    good.release()
