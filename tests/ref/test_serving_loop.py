"""The serving loop's bad inputs: a batch whose key disagrees with its rows, and a
scheduler configured so that it could never run, are ConfigErrors naming the argument."""

from __future__ import annotations

import pytest
import torch

from graphguard.dispatch import BatchKey
from graphguard.errors import ConfigError
from graphguard_ref.demo.engine import run_engine_demo, timing_label
from graphguard_ref.serving_loop import EngineScheduler, Request, Rows, make_batch

CPU = torch.device("cpu")


def _batch(rows: list[Rows], n: int, *, positions: list[int] | None = None):
    return make_batch([1] * n, positions or list(range(n)), [0] * n, rows, CPU)


@pytest.mark.parametrize(
    ("rows", "n", "match"),
    [
        # two decode rows but three tokens: the old key said decode(2, 1) = 2 tokens
        ([Rows(0, 0, 1, "decode"), Rows(1, 1, 1, "decode")], 3, "cover 2 tokens, the batch has 3"),
        ([Rows(0, 0, 2, "prefill")], 1, "cover 2 tokens, the batch has 1"),
        ([Rows(0, 0, 1, "decode"), Rows(1, 2, 1, "decode")], 3, "starts at token 2, expected 1"),
        ([Rows(0, 0, 2, "decode")], 2, "a decode row is 1 token"),
        ([Rows(0, 0, 3, "verify", (5,))], 3, "1 \\+ len\\(drafts\\) = 2"),
        ([Rows(0, 0, 1, "decode"), Rows(0, 1, 1, "decode")], 2, "more than one row"),
        ([Rows(0, 0, 0, "prefill"), Rows(1, 0, 1, "decode")], 1, "length 0"),
        ([Rows(0, 0, 1, "sample")], 1, "kind must be"),  # type: ignore[arg-type]
        ([], 1, "no rows"),
    ],
)
def test_make_batch_refuses_rows_that_disagree_with_the_tokens(rows, n, match):
    with pytest.raises(ConfigError, match=match):
        _batch(rows, n)


def test_make_batch_refuses_two_tokens_on_one_cache_cell():
    rows = [Rows(0, 0, 1, "decode"), Rows(1, 1, 1, "decode")]
    with pytest.raises(ConfigError, match="share a \\(slot, position\\)"):
        _batch(rows, 2, positions=[4, 4])


def test_make_batch_refuses_unequal_input_lengths():
    with pytest.raises(ConfigError, match="equal, non-zero lengths, got 2, 1, 2"):
        make_batch([1, 2], [0], [0, 1], [Rows(0, 0, 2, "prefill")], CPU)


def test_make_batch_key_always_counts_the_tokens_it_was_given():
    b = _batch([Rows(0, 0, 3, "verify", (7, 8)), Rows(1, 3, 1, "prefill")], 4)
    assert b.key == BatchKey.mixed(4, 2) and b.key.num_tokens == b.token_ids.shape[0]


GOOD = {"max_batch": 2, "max_context": 32, "max_tokens": 16, "vocab": 50}


@pytest.mark.parametrize(
    ("arg", "value"),
    [
        ("max_batch", 0),
        ("max_batch", -1),
        ("max_batch", True),
        ("max_context", 0),
        ("max_tokens", 0),
        ("vocab", 0),
        ("spec_tokens", -1),
        ("prompt_len", 0),
        ("chunk", 0),
        ("max_new", 0),
        ("max_batch", 2.5),
    ],
)
def test_scheduler_refuses_arguments_that_could_never_run(arg, value):
    with pytest.raises(ConfigError, match=f"{arg} must be an int >= "):
        EngineScheduler(**{**GOOD, arg: value})


def test_scheduler_refuses_a_context_too_short_for_a_verify_step():
    with pytest.raises(ConfigError, match="max_context=4 is too small for q=3"):
        EngineScheduler(**{**GOOD, "max_context": 4, "spec_tokens": 2, "max_tokens": 64})


def test_commit_refuses_a_greedy_list_of_the_wrong_length():
    s = EngineScheduler(**GOOD)
    s.set_live(1)
    b = s.next_batch(CPU)
    assert b is not None
    with pytest.raises(ConfigError, match=f"for a batch of {b.num_tokens}"):
        s.commit(b, [0] * (b.num_tokens + 1))


def test_a_one_slot_scheduler_admits_and_serves():
    s = EngineScheduler(**{**GOOD, "max_batch": 1})
    s.set_live(1)
    b = s.next_batch(CPU)
    assert b is not None and len(s.live) == 1


# ------------------------------------------------------------------ speculative decoding


def _drafts_for(history: list[int], k: int) -> tuple[int, ...]:
    s = EngineScheduler(**{**GOOD, "spec_tokens": k, "max_tokens": 2 * (1 + k)})
    req = Request(rid=0, slot=0, prompt=history[:1], max_new=100, pos=1, out=history[1:])
    return s._drafts(req, k)


def test_prompt_lookup_continues_a_loop_with_full_drafts():
    assert _drafts_for([3, 9, 211, 211, 211], 2) == (211, 211)
    assert _drafts_for([1, 5, 6, 7, 5, 6, 7, 5, 6], 3) == (7, 5, 6)


def test_prompt_lookup_prefers_the_longest_matching_ngram():
    # "6" last followed by 1, but the trigram "4 5 6" last followed by 8.
    assert _drafts_for([4, 5, 6, 8, 9, 0, 6, 1, 2, 4, 5, 6], 1) == (8,)


def test_prompt_lookup_without_a_match_repeats_the_last_token():
    assert _drafts_for([1, 2, 3], 2) == (3, 3)


def test_engine_demo_on_the_tiny_preset_accepts_drafts_and_emits_more_than_one_token_per_step():
    lines: list[str] = []
    result = run_engine_demo(
        preset="tiny",
        max_batch=4,
        max_context=256,
        steps=120,
        phases=(4, 2, 4),
        mode="none",
        spec_tokens=2,
        prompt_len=6,
        chunk=8,
        device="cpu",
        out=lines.append,
    )
    spec = result.spec
    assert spec["drafted"] > 0 and spec["accepted"] > 0
    assert spec["acceptance"] > 0.1 and spec["tokens_per_step"] > 1.1
    text = "\n".join(lines)
    assert "drafts accepted" in text and "tokens per request per verify step" in text
    assert result.check["argmax_agreement"] == 1.0


def test_timing_labels_split_mixed_batches_by_size():
    def mixed(n: int):
        return _batch([Rows(0, 0, n, "prefill")], n)

    assert [timing_label(mixed(n)) for n in (3, 64, 65, 300)] == [
        "mixed<=64",
        "mixed<=64",
        "mixed<=256",
        "mixed>256",
    ]
    assert timing_label(_batch([Rows(0, 0, 1, "decode")], 1)) == "decode"
