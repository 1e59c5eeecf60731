"""Why does the first decode step at a new batch size cost ~60-100 ms? Time the first
call of the reference model's attention (SDPA with a mask, llama-1b shapes, bf16) at
batch sizes never seen before, with the default SDPA backend choice and with each
backend forced, plus the first call of the lm_head GEMM at a new M. Prints a table."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def first_ms(fn) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    kvh, group, hd, ctx = 8, 4, 64, 1024
    print("cudnn sdp enabled:", torch.backends.cuda.cudnn_sdp_enabled())
    choices = {
        "default": None,
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "math": [SDPBackend.MATH],
    }
    sizes = {"default": [3, 5], "cudnn": [7, 9], "efficient": [11, 13], "math": [17, 19]}
    for name, backends in choices.items():
        for b in sizes[name]:
            q = torch.randn(b, kvh, group, hd, device=dev, dtype=dt)
            k = torch.randn(b, kvh, ctx, hd, device=dev, dtype=dt)
            v = torch.randn_like(k)
            mask = torch.zeros(b, 1, 1, ctx, device=dev, dtype=dt)

            def call(q=q, k=k, v=v, mask=mask, backends=backends) -> None:  # type: ignore[no-untyped-def]
                if backends is None:
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                else:
                    with sdpa_kernel(backends):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

            try:
                first = first_ms(call)
                second = first_ms(call)
                print(
                    f"sdpa {name:>9} B={b:>3}: first call {first:8.2f} ms, second {second:6.2f} ms"
                )
            except RuntimeError as exc:
                print(f"sdpa {name:>9} B={b:>3}: not available ({str(exc).splitlines()[0][:80]})")
    w = torch.randn(128256, 2048, device=dev, dtype=dt)
    for b in (21, 23):
        x = torch.randn(b, 2048, device=dev, dtype=dt)
        print(
            f"lm_head GEMM M={b}: first call {first_ms(lambda x=x: x @ w.t()):.2f} ms, "
            f"second {first_ms(lambda x=x: x @ w.t()):.2f} ms"
        )


if __name__ == "__main__":
    main()
