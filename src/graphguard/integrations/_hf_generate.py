"""``GraphedCausalLM.generate``'s arguments, resolved and checked the way HF's ``generate``
resolves them, before anything runs on the device.

Settings (:func:`resolve_settings`) follow ``GenerationMixin._prepare_generation_config``
(transformers 5.17-5.24): an argument passed to ``generate`` wins, even ``None`` (which
turns that warper off, as in HF: ``top_k=None`` is no top-k); an argument not passed
(:data:`FROM_CONFIG`) takes the ``generation_config=`` argument's value, else
``model.generation_config``'s, else HF's global default (``top_k=50``, ``temperature=1.0``,
``do_sample=False``). Settings ``generate`` does not apply (beams, repetition penalty, ...,
:data:`._hf_support.UNAPPLIED`) are refused by name: :class:`ConfigError` when passed,
:class:`UnsupportedModelError` when the model's own ``generation_config`` enables them.

Prompts (:func:`prepare_prompts`): integer ``input_ids`` whose every id is in the
vocabulary (an id out of range is a device-side assert on a GPU, which poisons the CUDA
context, so it is checked first, naming the position), a 0/1 ``attention_mask`` of the
same shape (inferred from ``pad_token_id`` when not given, as HF does), no row without a
token. Right-padded rows are converted: each row whose last column is padding is shifted
right by its trailing padding, so it is the left-padded equivalent (HF warns and decodes
such rows wrongly; the converted row decodes as HF does the left-padded prompt).
"""

from __future__ import annotations

import difflib
import enum
import logging
from dataclasses import dataclass
from typing import Any, Final

import torch

from graphguard.errors import ConfigError, UnsupportedModelError
from graphguard.integrations._hf_support import (
    FALLBACK,
    UNAPPLIED,
    generation_problems,
    unapplied,
)
from graphguard.sizes import is_int

logger = logging.getLogger("graphguard")


class FromConfig(enum.Enum):
    """The type of :data:`FROM_CONFIG`: an argument not passed to ``generate``."""

    FROM_CONFIG = "FROM_CONFIG"

    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG: Final = FromConfig.FROM_CONFIG
"""Not passed: the value of the ``generation_config`` argument, else of
``model.generation_config``, else HF's default (as HF's ``generate`` does)."""

DEFAULT_NEW_TOKENS = 20
"""New tokens when neither ``max_new_tokens`` nor ``max_length`` is set anywhere (HF's
model-agnostic default, ``max_length = prompt + 20``)."""

_HF_DEFAULTS: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}

_IGNORED = {
    # accepted with any value: they change neither the tokens nor the returned tensor here
    "use_cache",
    "cache_implementation",
    "cache_config",
    "compile_config",
    "disable_compile",
    "early_stopping",
    "length_penalty",
    "bos_token_id",
    "decoder_start_token_id",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_lookbehind",
    "target_lookbehind",
    "encoder_repetition_penalty",  # HF ignores it for decoder-only models (and warns)
    "encoder_no_repeat_ngram_size",
    "low_memory",
    "max_cache_len",
}
_OFF_WHEN_FALSY = {
    # HF arguments generate does not provide: accepted only as None / False / empty
    "assistant_model": "assisted generation",
    "assistant_tokenizer": "assisted generation",
    "tokenizer": "stop strings",
    "logits_processor": "custom logits processors",
    "stopping_criteria": "custom stopping criteria",
    "prefix_allowed_tokens_fn": "constrained generation",
    "streamer": "streaming",
    "negative_prompt_ids": "classifier-free guidance",
    "negative_prompt_attention_mask": "classifier-free guidance",
    "synced_gpus": "multi-GPU synced generation",
    "custom_generate": "a custom decoding loop",
    "return_dict_in_generate": "a dict result (generate returns token ids)",
    "output_scores": "scores in the result (generate returns token ids)",
    "output_logits": "logits in the result (generate returns token ids)",
    "output_attentions": "attentions in the result (generate returns token ids)",
    "output_hidden_states": "hidden states in the result (generate returns token ids)",
    "inputs_embeds": "embeddings as the prompt (pass input_ids)",
}
_OWN = (
    "max_new_tokens",
    "max_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "eos_token_id",
    "pad_token_id",
    "generator",
    "generation_config",
)


@dataclass(frozen=True)
class Settings:
    """What one ``generate`` call does, resolved and checked."""

    max_new_tokens: int | None
    """None: ``max_length - prompt`` (:attr:`max_length`), known once the prompt is."""
    max_length: int | None
    do_sample: bool
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    eos: tuple[int, ...]
    pad: int | None

    def new_tokens(self, prompt: int) -> int:
        """New tokens for a prompt of ``prompt`` columns."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is None:
            return DEFAULT_NEW_TOKENS
        if self.max_length <= prompt:
            raise ConfigError(
                f"generate: max_length={self.max_length} (from the arguments or "
                f"generation_config) leaves no new token after a prompt of {prompt}; pass "
                "max_new_tokens=N"
            )
        return self.max_length - prompt


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def resolve_settings(
    model: Any, vocab: int, passed: dict[str, Any], extra: dict[str, Any]
) -> Settings:
    """HF's resolution of ``passed`` (the named arguments, :data:`FROM_CONFIG` when not
    given) and ``extra`` (any other keyword) over the configs; every bad value raised."""
    given_cfg = extra.pop("generation_config", None)
    if given_cfg is not None and not hasattr(given_cfg, "to_dict"):
        raise ConfigError(
            "generate: generation_config must be a transformers GenerationConfig, got "
            f"{type(given_cfg).__name__}"
        )
    passed = {**passed, "max_length": extra.pop("max_length", FROM_CONFIG)}
    _refuse_extra(extra)
    own = getattr(model, "generation_config", None)
    reasons = generation_problems(own)  # set after construction: refused at use
    if reasons:
        raise UnsupportedModelError(f"generate: {reasons[0]}", reasons=tuple(reasons))
    if given_cfg is not None and (
        problems := unapplied({k: getattr(given_cfg, k, None) for k in UNAPPLIED})
    ):
        raise ConfigError(
            f"generate: generation_config= enables what GraphedCausalLM.generate does not "
            f"apply ({', '.join(problems)}); unset them or use model.generate"
        )

    def value(key: str) -> Any:
        if passed.get(key, FROM_CONFIG) is not FROM_CONFIG:
            return passed[key]
        for cfg in (given_cfg, own):
            v = getattr(cfg, key, None) if cfg is not None else None
            if v is not None:
                return v
        return _HF_DEFAULTS.get(key)

    do_sample = value("do_sample")
    if do_sample is None:
        do_sample = False  # HF: anything but True is greedy
    if not isinstance(do_sample, bool):
        raise ConfigError(f"generate: do_sample must be a bool, got {do_sample!r}")
    temperature, top_k, top_p, min_p = (
        value(k) for k in ("temperature", "top_k", "top_p", "min_p")
    )
    for key, v, ok, want in (
        ("temperature", temperature, _is_real(temperature), "a number > 0"),
        ("top_k", top_k, is_int(top_k) and top_k >= 0, "an int >= 0 (0: no top-k)"),
        ("top_p", top_p, _is_real(top_p) and 0 <= top_p <= 1, "a number in [0, 1] (1: no top-p)"),
        ("min_p", min_p, _is_real(min_p) and 0 <= min_p <= 1, "a number in [0, 1]"),
    ):
        if v is not None and not ok:
            raise ConfigError(
                f"generate: {key} must be {want} or None (that warper off), got {v!r} "
                f"({type(v).__name__})"
            )
    if do_sample and temperature is not None and not temperature > 0:
        raise ConfigError(
            f"generate: temperature={temperature!r} with do_sample=True: it must be > 0 "
            "(for greedy decoding pass do_sample=False)"
        )
    max_new, max_length = value("max_new_tokens"), value("max_length")
    for key, v in (("max_new_tokens", max_new), ("max_length", max_length)):
        if v is not None and not (is_int(v) and v >= 1):
            raise ConfigError(f"generate: {key} must be an int >= 1, got {v!r}")
    eos = _token_ids("eos_token_id", value("eos_token_id"), vocab)
    pad_list = _token_ids("pad_token_id", value("pad_token_id"), vocab, single=True)
    pad = pad_list[0] if pad_list else (eos[0] if eos else None)  # HF: pad = eos[0] (it warns)
    return Settings(
        max_new_tokens=max_new,
        max_length=max_length if max_new is None else None,
        do_sample=do_sample,
        temperature=None if temperature is None else float(temperature),
        top_k=top_k,
        top_p=None if top_p is None else float(top_p),
        min_p=None if min_p is None else float(min_p),
        eos=eos,
        pad=pad,
    )


def _token_ids(key: str, v: Any, vocab: int, *, single: bool = False) -> tuple[int, ...]:
    """``v`` (None, an id, a list or tensor of ids) as ids in ``[0, vocab)``, or raise."""
    if v is None:
        return ()
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    items = [v] if is_int(v) or single else v
    if not isinstance(items, (list, tuple)) or not all(is_int(i) for i in items):
        raise ConfigError(
            f"generate: {key} must be {'an int' if single else 'an int or a list of ints'} "
            f"or None, got {v!r}"
        )
    bad = [i for i in items if not 0 <= i < vocab]
    if bad:
        raise ConfigError(
            f"generate: {key}={v!r}: {bad[0]} is not a token id of the model (vocabulary "
            f"{vocab}: ids 0..{vocab - 1}); finished rows are fed this id, so it must embed"
        )
    return tuple(int(i) for i in items)


def _refuse_extra(extra: dict[str, Any]) -> None:
    """Every keyword ``generate`` does not apply, by name (neutral values pass)."""
    bad: list[str] = []
    unknown: list[str] = []
    for key, v in extra.items():
        if key in _IGNORED:
            continue
        if key in _OFF_WHEN_FALSY:
            if v is not None and v is not False and not (isinstance(v, (list, tuple)) and not v):
                bad.append(f"{key}= ({_OFF_WHEN_FALSY[key]})")
        elif key in UNAPPLIED:
            bad += unapplied({key: v})
        else:
            close = difflib.get_close_matches(key, [*_OWN, *UNAPPLIED, *_OFF_WHEN_FALSY], n=1)
            unknown.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if unknown:
        raise ConfigError(
            f"generate: unknown argument(s) {', '.join(unknown)}; GraphedCausalLM.generate "
            f"takes input_ids, attention_mask and {', '.join(_OWN)}"
        )
    if bad:
        raise ConfigError(
            f"generate: GraphedCausalLM.generate does not apply {', '.join(bad)}; drop "
            f"them (neutral values such as num_beams=1 are accepted) or {FALLBACK}"
        )


# ---------------------------------------------------------------------- prompts


def _position(flat_index: int, width: int) -> str:
    return f"[{flat_index // width}, {flat_index % width}]"


def prepare_prompts(
    input_ids: Any,
    attention_mask: Any,
    *,
    vocab: int,
    max_batch: int,
    settings: Settings,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` as ``long`` tensors on ``device``, left-padded, every id embeddable.

    The checks read the host once or twice (a min/max and a padding-side reduction) and
    run before the first device op that would index with the ids.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ConfigError(
            f"generate: input_ids must be a [batch, prompt] tensor, got "
            f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
        )
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise ConfigError(
            f"generate: input_ids must hold integer token ids, got dtype {input_ids.dtype} "
            "(a float id such as 5.9 would run as 5); pass a torch.long tensor, e.g. "
            "tokenizer(..., return_tensors='pt').input_ids"
        )
    batch, prompt = input_ids.shape
    if not 1 <= batch <= max_batch:
        raise ConfigError(
            f"generate: batch {batch} is not in [1, max_batch={max_batch}]; split it "
            "or build GraphedCausalLM with a larger max_batch"
        )
    if prompt < 1:
        raise ConfigError("generate: input_ids has no column (prompt length 0); pass a prompt")
    lo, hi = (int(x) for x in torch.aminmax(input_ids))
    if lo < 0 or hi >= vocab:
        flat = input_ids.reshape(-1)
        first = int(((flat < 0) | (flat >= vocab)).nonzero()[0])
        raise ConfigError(
            f"generate: input_ids{_position(first, prompt)} = {int(flat[first])} is not a "
            f"token id of the model (vocabulary {vocab}: ids 0..{vocab - 1}); nothing ran "
            "(on a GPU it would be a device-side assert that poisons the CUDA context). "
            "Check the tokenizer matches the model, or resize the embeddings"
        )
    ids = input_ids.to(device, torch.long)
    mask = _mask(ids, attention_mask, settings, device)
    has = mask.bool()
    empty = (~has.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ConfigError(
            f"generate: attention_mask row(s) {empty} are all 0: those prompts have no "
            "token to continue; drop them or give each at least one 1"
        )
    right = (mask[:, -1] == 0).nonzero().flatten()
    if right.numel():
        # Shift each right-padded row right by its trailing padding: the left-padded
        # equivalent. Trailing zeros = columns after the last 1.
        cols = torch.arange(prompt, device=device)
        last = torch.where(has, cols, -1).amax(dim=1)
        shift = (prompt - 1 - last)[:, None]
        index = (cols[None, :] - shift) % prompt
        ids, mask = ids.gather(1, index), mask.gather(1, index)
        logger.info(
            "generate: rows %s are right-padded; shifted to the left-padded equivalent "
            "(what decoder-only generation needs; tokenizer padding_side='left' avoids it)",
            right.tolist(),
        )
    return ids, mask


def _mask(
    ids: torch.Tensor, attention_mask: Any, settings: Settings, device: torch.device
) -> torch.Tensor:
    """The 0/1 ``long`` mask: checked, or inferred from the pad id as HF infers it."""
    if attention_mask is None:
        pad, eos = settings.pad, settings.eos
        if pad is not None and pad not in eos and bool((ids == pad).any()):
            return ids.ne(pad).long()  # HF: padding inferred when pad != eos
        return torch.ones_like(ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != ids.shape:
        raise ConfigError(
            f"generate: attention_mask must be a tensor of the shape of input_ids "
            f"{tuple(ids.shape)} (1 on tokens, 0 on padding; a dict of 4D masks is not "
            f"accepted), got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}"
        )
    mask = attention_mask.to(device)
    off = (mask != 0) & (mask != 1)
    if bool(off.any()):
        first = int(off.reshape(-1).nonzero()[0])
        value = mask.reshape(-1)[first].item()
        raise ConfigError(
            f"generate: attention_mask{_position(first, ids.shape[1])} = {value!r}: the "
            "mask must be 0 (padding) or 1 (token) everywhere"
        )
    return mask.long()


def generate_inputs(
    model: Any,
    passed: dict[str, Any],
    extra: dict[str, Any],
    generator: Any,
    input_ids: Any,
    attention_mask: Any,
    *,
    vocab: int,
    max_batch: int,
    max_cache_len: int,
    device: torch.device,
) -> tuple[Settings, torch.Tensor, torch.Tensor, int]:
    """Everything ``generate`` refuses before the device runs, in order: the settings
    (:func:`resolve_settings`), the ``generator`` (on the model's device type), the
    prompts (:func:`prepare_prompts`), and the prompt plus the new tokens fitting the
    cache. The settings, the prompts' ids and mask, and how many tokens to generate."""
    settings = resolve_settings(model, vocab, passed, extra)
    if generator is not None and (
        not isinstance(generator, torch.Generator) or generator.device.type != device.type
    ):
        raise ConfigError(
            f"generate: generator must be a torch.Generator on {device.type} (the "
            f"model's device), got {getattr(generator, 'device', type(generator).__name__)}"
        )
    ids, mask2d = prepare_prompts(
        input_ids,
        attention_mask,
        vocab=vocab,
        max_batch=max_batch,
        settings=settings,
        device=device,
    )
    prompt = ids.shape[1]
    new = settings.new_tokens(prompt)
    if prompt + new > max_cache_len:
        raise ConfigError(
            f"generate: prompt {prompt} + max_new_tokens {new} does not fit "
            f"max_cache_len {max_cache_len}; shorten them or build with a longer cache"
        )
    return settings, ids, mask2d, new


__all__ = [
    "FROM_CONFIG",
    "FromConfig",
    "Settings",
    "generate_inputs",
    "prepare_prompts",
    "resolve_settings",
]
