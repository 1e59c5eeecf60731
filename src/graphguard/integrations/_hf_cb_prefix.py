"""HF's prefix cache (block sharing in the paged KV cache), dropped when the weights change.

HF's paged cache hashes every full page of KV a request computes (its tokens and its
parent page's hash) and, with ``ContinuousBatchingConfig.allow_block_sharing`` (the
default), a later request whose prompt starts with the same tokens takes those blocks
instead of recomputing them. The hashes outlive their requests: a block no request holds
stays cached until memory runs short, and a persistent manager keeps them across
``generate_batch`` calls (its processor's reset frees the requests, not the hashes: 5.17's
``free_all_requests`` says so, "allowing prefix sharing to work across generation
sessions"). A hash records tokens, not the weights the KV was computed with: after an
in-place weight update the same prompt prefix is served the old weights' KV, and tokens
differ from a fresh engine's from the first one on. :func:`drop` forgets every hash and
gives the blocks kept only for them back to the free pool.

Two layouts, told apart by their attributes (not by version numbers):

- ``"ledger"`` (transformers 5.2x): ``cache.cache_allocators`` (a dict), each allocator
  with a ``block_table`` and a ``ledger`` (``BlockLedger``: ``hash_to_block``,
  ``cached_blocks``); ``cache.evict_cached_blocks()`` is HF's own eviction (called under
  memory pressure) of every cached block, hashes included.
- ``"block_manager"`` (transformers 5.17): ``cache.group_cache_managers`` (a list), each
  with a ``block_table``, and one ``cache._block_manager`` (``BlockManager``:
  ``_hash_to_id``, ``_init_block_ids``); its ``has_enough_free_blocks(n)`` is HF's own
  eviction: it un-hashes as many cached ("initialized") blocks as ``n`` needs, so asked for
  every free block it un-hashes them all.

A layout with neither is refused (:class:`~graphguard.errors.UnsupportedModelError` naming
the transformers version) before any weight is loaded, never left stale.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from graphguard.errors import ConfigError, UnsupportedModelError

logger = logging.getLogger("graphguard")

_LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (what the cache has, what its ledger / block manager has)
    "ledger": (
        ("cache_allocators", "evict_cached_blocks", "free_all_requests"),
        ("hash_to_block", "cached_blocks", "evict_cached_blocks"),
    ),
    "block_manager": (
        ("group_cache_managers", "_block_manager", "free_all_requests"),
        ("_hash_to_id", "_init_block_ids", "has_enough_free_blocks", "num_free_blocks"),
    ),
}


def _allocators(cache: Any) -> list[Any]:
    managers = getattr(cache, "cache_allocators", None)
    if isinstance(managers, dict):
        return list(managers.values())
    return list(getattr(cache, "group_cache_managers", None) or ())


def layout(cache: Any) -> str | None:
    """``"ledger"``, ``"block_manager"``, or None (a layout this module does not know)."""
    allocators = _allocators(cache)
    if not allocators or not all(hasattr(a, "block_table") for a in allocators):
        return None
    if all(hasattr(cache, a) for a in _LAYOUTS["ledger"][0]):
        ledgers = [getattr(a, "ledger", None) for a in allocators]
        if all(all(hasattr(x, n) for n in _LAYOUTS["ledger"][1]) for x in ledgers):
            return "ledger"
    if all(hasattr(cache, a) for a in _LAYOUTS["block_manager"][0]):
        bm = cache._block_manager
        if all(hasattr(bm, n) for n in _LAYOUTS["block_manager"][1]):
            return "block_manager"
    return None


def check(cache: Any, version: str) -> str:
    """The cache's layout; :class:`UnsupportedModelError` naming ``version`` if unknown."""
    kind = layout(cache)
    if kind is None:
        why = (
            f"HF's paged cache ({type(cache).__name__}) in transformers {version} has neither "
            "prefix-cache layout graphguard knows (5.2x: cache_allocators with a BlockLedger "
            "and evict_cached_blocks(); 5.17: group_cache_managers with a BlockManager), so "
            "the blocks its prefix cache keeps (KV of the old weights) cannot be dropped on a "
            "weight update; nothing was loaded. Update weights with close() and a new engine, "
            "or use a transformers version graphguard supports"
        )
        raise UnsupportedModelError(why, reasons=(why,))
    return kind


def holders(cache: Any) -> set[str]:
    """Ids of the requests that hold blocks of ``cache`` (in flight, or left by a stop)."""
    out: set[str] = set()
    for a in _allocators(cache):
        out.update(k for k, v in a.block_table.items() if v is not None)
    return out


def hashed(cache: Any) -> int:
    """How many block hashes ``cache`` keeps (0 for an unknown layout)."""
    kind = layout(cache)
    if kind == "ledger":
        return sum(len(a.ledger.hash_to_block) for a in _allocators(cache))
    if kind == "block_manager":
        return len(cache._block_manager._hash_to_id)
    return 0


def sharing(cache: Any) -> bool:
    """Whether ``cache`` hashes blocks at all (``allow_block_sharing``; True if unknown)."""
    return bool(getattr(cache, "allow_block_sharing", True))


def drop(cache: Any, version: str, *, free_requests: bool) -> int:
    """Forget every block hash of ``cache`` and give the blocks kept only for them back to
    the free pool; with ``free_requests`` first free every request's blocks (only when no
    generation loop runs: HF's next start frees them anyway). Returns the hashes dropped.
    Raises if a hash is left (a request still holds its block)."""
    kind = check(cache, version)
    before = hashed(cache)
    if free_requests:
        cache.free_all_requests()
    if kind == "ledger":
        cache.evict_cached_blocks()
    else:
        bm = cache._block_manager
        bm.has_enough_free_blocks(bm.num_free_blocks)
    left = hashed(cache)
    if left:
        raise RuntimeError(
            f"graphguard: {left} block hash(es) of HF's prefix cache are still held by "
            f"request(s) {sorted(holders(cache))[:4]} after the weight update (transformers "
            f"{version}): a new request could re-use their KV, computed with the old "
            "weights. close() and start a new engine"
        )
    return before


def engine_caches(engines: Sequence[Any], model: Any, version: str) -> list[tuple[Any, bool]]:
    """Every paged cache ``engines`` (``StepGraphs``) and ``model``'s cached HF manager may
    serve again, with whether its generation loop runs. Refuses, before any weight is
    loaded, what a weight update cannot leave right: an unknown layout
    (:func:`check`), and requests holding blocks of a running manager with block sharing
    on (their old-weight pages would be hashed and shared after the update)."""
    found: dict[int, tuple[Any, Any]] = {}
    for e in engines:
        processor = e.processor_ref() if e.processor_ref is not None else None
        manager = e.manager_ref() if e.manager_ref is not None else None
        cache = getattr(processor, "cache", None)
        if cache is not None:
            found.setdefault(id(cache), (cache, manager))
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    processor = getattr(manager, "batch_processor", None)
    if processor is not None and getattr(processor, "cache", None) is not None:
        found.setdefault(id(processor.cache), (processor.cache, manager))
    out = []
    for cache, manager in found.values():
        check(cache, version)
        is_running = getattr(manager, "is_running", None)
        running = bool(is_running()) if callable(is_running) else False
        held = holders(cache)
        if running and held and sharing(cache):
            raise ConfigError(
                f"GraphedContinuousBatching.update_weights: {len(held)} request(s) hold "
                "blocks of HF's paged cache in a running manager, with block sharing on: "
                "their pages, computed with the old weights, would be hashed and shared "
                "with new requests after the update; nothing was loaded. Update between "
                "generate_batch calls (or with no request in flight), or build the engine "
                "with ContinuousBatchingConfig(allow_block_sharing=False)"
            )
        out.append((cache, running))
    return out


def drop_all(caches: Sequence[tuple[Any, bool]], version: str) -> None:
    """:func:`drop` each of ``caches`` (from :func:`engine_caches`), freeing requests' blocks
    only where no generation loop runs."""
    for cache, running in caches:
        n = drop(cache, version, free_requests=not running)
        if n:
            logger.info(
                "update_weights: dropped %d block hash(es) of HF's prefix cache (KV of the "
                "old weights)",
                n,
            )


__all__ = [
    "check",
    "drop",
    "drop_all",
    "engine_caches",
    "hashed",
    "holders",
    "layout",
    "sharing",
]
