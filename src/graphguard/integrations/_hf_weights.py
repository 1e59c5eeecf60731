"""``GraphedCausalLM.update_weights``: Hugging Face names and local safetensors checkpoints.

The graphs read the model's parameters in place, so an update is
:func:`graphguard.weights.update_weights` on the decode runner with the model's own
(Hugging Face) names. What this adds: a local ``.safetensors`` file or a directory of them
(``save_pretrained`` output, sharded or not, read through ``safetensors``), names saved
from the base model (``layers.0...`` for ``model.layers.0...``) mapped to the model's,
and a recapture that restores the KV cache as :meth:`GraphedCausalLM.capture` does.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from graphguard.errors import ConfigError


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file, or of the shards a directory holds (its
    ``model.safetensors.index.json`` when there is one), on the CPU."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:  # pragma: no cover - an optional extra
        raise ConfigError(
            "update_weights from a checkpoint path needs safetensors: pip install "
            "'safetensors>=0.4' (or pass a state dict)"
        ) from exc
    p = Path(path)
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({p / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"update_weights: no .safetensors file in {p}")
    elif p.is_file():
        files = [p]
    else:
        raise ConfigError(f"update_weights: {p} is neither a .safetensors file nor a directory")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f), device="cpu").items():
            if name in out:
                raise ConfigError(
                    f"update_weights: {name} is in two shards of {p} (one is {f.name})"
                )
            out[name] = t
    return out


def hf_names(model: Any, source: Mapping[str, Any]) -> dict[str, Any]:
    """``source`` with base-model names (saved from ``model.model``) given the model's
    prefix; names the model has are kept as they are."""
    own = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    own |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    prefix = getattr(model, "base_model_prefix", "") or ""
    out: dict[str, Any] = {}
    for name, t in source.items():
        if name not in own and prefix and f"{prefix}.{name}" in own:
            name = f"{prefix}.{name}"
        out[name] = t
    return out


def _restoring(lm: Any) -> Any:
    """A recapture as :meth:`GraphedCausalLM.capture` runs one: the cache restored."""
    from graphguard.integrations._hf_guards import refuse_host_copies

    def restored() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(lm.cache_restored())
        stack.enter_context(refuse_host_copies(lm.model, lm.runner))
        return stack

    return restored


def refit(lm: Any, **kw: Any) -> Any:
    """See :meth:`GraphedCausalLM.refit`."""
    from graphguard.weights.update import refit as weights_refit

    return weights_refit([lm.runner.door], around_recapture=_restoring(lm), **kw)


def update(lm: Any, source: Any, *, on_moved: str, strict: bool) -> Any:
    """See :meth:`GraphedCausalLM.update_weights`."""
    from graphguard.weights import update_weights

    restored = _restoring(lm)
    if isinstance(source, (str, os.PathLike)):
        source = load_safetensors(source)
    if isinstance(source, Mapping):
        source = hf_names(lm.model, source)
    return update_weights(
        [lm.runner.door], source, on_moved=on_moved, strict=strict, around_recapture=restored
    )


__all__ = ["hf_names", "load_safetensors", "refit", "update"]
