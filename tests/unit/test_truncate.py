"""Head + tail truncation (contract 12, docs/reference/codex-behaviour.md#truncation)."""

from toolq.core.truncate import TruncationPolicy, formatted_truncate_text, truncate_text


def test_text_within_budget_is_unchanged():
    assert truncate_text("abc", TruncationPolicy.bytes(3)) == "abc"


def test_bytes_policy_keeps_head_and_tail_with_char_marker():
    assert truncate_text("abcdefghij", TruncationPolicy.bytes(4)) == "ab…6 chars truncated…ij"


def test_tokens_policy_counts_removed_tokens():
    text = "x" * 100
    out = truncate_text(text, TruncationPolicy.tokens(5))  # 20 bytes kept
    assert out == "x" * 10 + "…20 tokens truncated…" + "x" * 10


def test_exec_figures_match_codex():
    text = "".join(f"{i}\n" for i in range(1, 30001))  # `seq 1 30000`
    out = truncate_text(text, TruncationPolicy.tokens(10_000))
    assert "…32224 tokens truncated…" in out
    head, _, tail = out.partition("…32224 tokens truncated…")
    assert len(head.encode()) == 20_000 and len(tail.encode()) == 20_000


def test_cut_never_splits_a_multibyte_character():
    text = "é" * 10  # 2 bytes each
    out = truncate_text(text, TruncationPolicy.bytes(5))
    head, _, tail = out.partition("…")
    assert head == "é" and tail.endswith("é")  # 2 of the 2.5 bytes a side: never half a character
    out.encode()  # valid UTF-8


def test_zero_budget_leaves_only_the_marker():
    assert truncate_text("abc", TruncationPolicy.bytes(0)) == "…3 chars truncated…"


def test_formatted_truncation_reports_total_lines_only_when_cut():
    assert formatted_truncate_text("a\nb\n", TruncationPolicy.bytes(100)) == "a\nb\n"
    out = formatted_truncate_text("line\n" * 50, TruncationPolicy.bytes(10))
    assert out.startswith("Total output lines: 50\n\n")


def test_bound_text_is_idempotent_so_worker_and_orchestrator_can_both_cut():
    from toolq.core.truncate import HISTORY_POLICY, MARKER_SLACK, bound_output, bound_text

    big = "é" + "x" * (5 * HISTORY_POLICY.byte_budget) + "end"
    once = bound_text(big)
    assert once != big and once.endswith("end") and len(once.encode()) <= HISTORY_POLICY.byte_budget + MARKER_SLACK
    assert bound_text(once) == once
    just_over = "y" * (HISTORY_POLICY.byte_budget + 10)
    assert bound_text(just_over) == just_over
    parts = bound_output([{"type": "input_text", "text": big}, {"type": "input_image", "image_url": "data:..."}])
    assert parts == [{"type": "input_text", "text": once}, {"type": "input_image", "image_url": "data:..."}]
