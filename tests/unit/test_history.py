"""The pairing normaliser (contract 8; docs/reference/codex-behaviour.md#history-repair)."""

from toolq.orchestrator.history import History, pairing_problems


def fc(call_id, name="exec_command"):
    return {"type": "function_call", "name": name, "arguments": "{}", "call_id": call_id}


def fco(call_id, output="ok"):
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def user(text="hi"):
    return {"type": "message", "role": "user", "content": text}


def test_paired_history_is_left_alone():
    h = History([user(), fc("a"), fc("b"), fco("a"), fco("b")])
    assert h.for_prompt() == [user(), fc("a"), fc("b"), fco("a"), fco("b")]
    assert not h.repairs


def test_missing_function_output_is_aborted_right_after_its_call():
    h = History([user(), fc("a"), fc("b"), fco("b")])
    out = h.for_prompt()
    assert out[1:4] == [fc("a"), fco("a", "aborted"), fc("b")]
    assert h.repairs["missing_output_aborted"] == 1


def test_missing_custom_output_gets_a_custom_output():
    call = {"type": "custom_tool_call", "name": "apply_patch", "input": "x", "call_id": "p"}
    out = History([call]).for_prompt()
    assert out[1] == {"type": "custom_tool_call_output", "call_id": "p", "output": "aborted"}


def test_missing_tool_search_output_gets_an_empty_search_output():
    call = {"type": "tool_search_call", "execution": "client", "call_id": "s", "arguments": {"query": "x"}}
    out = History([call]).for_prompt()
    assert out[1] == {"type": "tool_search_output", "call_id": "s", "status": "completed", "execution": "client", "tools": []}


def test_local_shell_call_is_answered_by_a_function_output():
    call = {"type": "local_shell_call", "id": "ls_1", "call_id": "l", "status": "completed", "action": {"type": "exec"}}
    out = History([call]).for_prompt()
    assert out[1]["type"] == "function_call_output" and out[1]["call_id"] == "l"


def test_orphan_outputs_are_dropped_and_counted():
    h = History([user(), fco("ghost"), {"type": "custom_tool_call_output", "call_id": "g2", "output": "x"}])
    assert h.for_prompt() == [user()]
    assert h.repairs["orphan_output_dropped"] == 2


def test_output_of_the_wrong_kind_does_not_pair():
    h = History([fc("a"), {"type": "custom_tool_call_output", "call_id": "a", "output": "x"}])
    out = h.for_prompt()
    assert [o["type"] for o in out] == ["function_call", "function_call_output"]
    assert h.repairs == {"missing_output_aborted": 1, "orphan_output_dropped": 1}


def test_server_tool_search_output_is_kept_without_a_call():
    server = {"type": "tool_search_output", "call_id": None, "execution": "server", "status": "completed", "tools": []}
    h = History([server])
    assert len(h.for_prompt()) == 1 and not h.repairs


def test_mixed_inserts_and_removals():
    h = History([fc("a"), fco("zzz"), fc("b"), fco("b")])
    assert [(o["type"], o["call_id"]) for o in h.for_prompt()] == [
        ("function_call", "a"),
        ("function_call_output", "a"),
        ("function_call", "b"),
        ("function_call_output", "b"),
    ]


def test_two_calls_with_the_same_call_id_are_both_kept_and_both_answered():
    h = History([fc("dup"), fc("dup"), fco("dup", "first")])
    out = h.for_prompt()
    assert [o["type"] for o in out].count("function_call") == 2
    assert [o["type"] for o in out].count("function_call_output") == 2
    assert pairing_problems(out) == []


def test_calls_with_an_empty_call_id_are_calls_and_keep_their_outputs():
    """A red-team helper's two calls with call_id "": both ran, both outputs were dropped as
    orphans, and the next request carried two unanswered calls."""
    h = History([fc(""), fc(""), fco("", "E1"), fco("", "E2")])
    out = h.for_prompt()
    assert out == [fc(""), fc(""), fco("", "E1"), fco("", "E2")] and not h.repairs
    assert pairing_problems([fc("")]) == ["call without output: "]
    assert History([fc("")]).for_prompt()[1] == fco("", "aborted")


def test_pairing_problems_names_both_directions():
    problems = pairing_problems([fc("a"), fco("b")])
    assert problems == ["call without output: a", "output without call: b"]


def test_repairs_persist_so_they_are_counted_once():
    h = History([fc("a")])
    h.for_prompt()
    h.for_prompt()
    assert h.repairs["missing_output_aborted"] == 1


def test_unknown_items_are_kept_out_of_the_prompt():
    h = History([user(), {"type": "brand_new", "x": 1}])
    assert h.for_prompt() == [user()]


# --- reasoning items under store: false ---------------------------------------------------------


def reasoning(**fields):
    return {"type": "reasoning", "id": "rs_1", "summary": [], **fields}


def test_reasoning_with_encrypted_content_or_raw_text_is_sent_back():
    encrypted = reasoning(encrypted_content="gAAAA")
    raw = reasoning(id="rs_2", content=[{"type": "reasoning_text", "text": "I should list files"}])
    h = History([user(), encrypted, raw, fc("a"), fco("a")])
    assert h.for_prompt() == [user(), encrypted, raw, fc("a"), fco("a")]
    assert not h.repairs


def test_reasoning_the_server_cannot_resolve_is_dropped_counted_and_logged_once(caplog):
    h = History([user(), reasoning(), fc("a"), fco("a")])
    with caplog.at_level("WARNING", logger="toolq.orchestrator.history"):
        assert h.for_prompt() == [user(), fc("a"), fco("a")]
        h.record(reasoning(id="rs_2", encrypted_content=""), fc("b"), fco("b"))
        assert h.for_prompt() == [user(), fc("a"), fco("a"), fc("b"), fco("b")]
    assert h.repairs == {"reasoning_without_encrypted_content_dropped": 2}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert warnings[0].startswith("dropped 1 reasoning item(s) without encrypted_content from the next request")


# --- constant work per step ------------------------------------------------------------------------


def test_each_item_is_serialised_once_and_paired_incrementally(monkeypatch):
    """200 steps of one session: every item becomes wire JSON once, when recorded, and its pairing
    role is read once; a step's `for_prompt` does not walk the history again (main converted every
    item twice per step: 80,802 conversions over 200 steps)."""
    import toolq.orchestrator.history as history
    from toolq.core.items import _Wire

    conversions, roles = [0], [0]
    to_wire, role = _Wire.to_wire, history._role

    def counted_to_wire(self):
        conversions[0] += 1
        return to_wire(self)

    def counted_role(obj):
        roles[0] += 1
        return role(obj)

    monkeypatch.setattr(_Wire, "to_wire", counted_to_wire)
    monkeypatch.setattr(history, "_role", counted_role)
    h = History([user()])
    for step in range(200):
        h.record(fc(f"c{step}"))
        h.record(fco(f"c{step}"))
        assert len(h.for_prompt()) == 1 + 2 * (step + 1)
    assert conversions[0] == len(h.items) == 401
    assert roles[0] == 401
    assert not h.repairs


def test_a_repair_after_incremental_steps_still_pairs():
    h = History([user(), fc("a"), fco("a")])
    assert h.for_prompt() == [user(), fc("a"), fco("a")]
    h.record(fc("b"), fco("zzz"), fc("b"))  # one answered twice below, one orphan output
    h.record(fco("b"))
    out = h.for_prompt()
    assert pairing_problems(out) == []
    assert h.repairs == {"orphan_output_dropped": 1, "missing_output_aborted": 1}
    h.record(fco("b", "late"))  # now the aborted one has a duplicate: an orphan, dropped
    assert pairing_problems(h.for_prompt()) == []
    assert h.repairs["orphan_output_dropped"] == 2
