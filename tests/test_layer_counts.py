"""`tests/layer_counts.py`, the figures issue 65 tracks: each method finds what it says on known code,
and the two traced paths run for real (a server over ZMQ, the HTTP front)."""

from __future__ import annotations

import ast

from tests import layer_counts


def test_the_static_counts_find_what_they_name(tmp_path):
    kinds = layer_counts.control_kind_files()
    assert "GENERATE" not in kinds and kinds.keys() >= {"PAUSE", "UPDATE_WEIGHTS", "SYNC_LORA"}
    assert all(count >= 1 for count in kinds.values())
    assert layer_counts._names_kind(ast.parse("x = Kind.PAUSE"), "PAUSE", {"Pause", "pause"})
    assert layer_counts._names_kind(ast.parse("client.update_weights(s)"), "UPDATE_WEIGHTS",
                                    {"UpdateWeights", "update_weights"})
    assert not layer_counts._names_kind(ast.parse("pauses = 1"), "PAUSE", {"Pause", "pause"})
    dispatch = [node for node in ast.walk(ast.parse(
        "if state == 'paused': pass\nif reply.kind in ('a', 'b'): pass\nif name == 'x': pass\nif mode == m: pass"))
        if isinstance(node, ast.Compare)]
    assert [layer_counts._is_string_dispatch(node) for node in dispatch] == [True, True, False, False]
    for package in layer_counts.PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "rollout" / "long.py").write_text("x = 1\n" * (layer_counts.MAX_LINES + 1) + "class Twice: pass\n")
    (tmp_path / "inference" / "short.py").write_text("x = 1\n" * (layer_counts.MAX_LINES - 1) + "class Twice: pass\n")
    (tmp_path / "weight_sync" / "once.py").write_text("class Once: pass\n")
    assert layer_counts.long_files(tmp_path) == {"rollout/long.py": layer_counts.MAX_LINES + 2}
    assert layer_counts.types_declared_twice(tmp_path) == {"Twice": ["inference/short.py", "rollout/long.py"]}
    (tmp_path / "weight_sync" / "aliases.py").write_text(
        "Count = Annotated[int, Meta(ge=0)]\nNonNeg = Annotated[int, Meta(ge=0)]\nPos = Annotated[int, Meta(ge=1)]\n")
    (tmp_path / "inference" / "alias.py").write_text("Pos = Annotated[int, Meta(ge=2)]\nplain = int\n")
    assert layer_counts.type_aliases_declared_twice(tmp_path) == {
        "Annotated[int, Meta(ge=0)]": ["weight_sync/aliases.py:Count", "weight_sync/aliases.py:NonNeg"]}
    assert layer_counts.type_aliases_declared_twice() == {}


def test_the_traced_paths_see_the_request_s_forms_threads_and_ids():
    figures = layer_counts.counts(traced=True)
    grpo, chat = figures["grpo_generate"], figures["openai_chat"]
    assert {"rollout.wire.messages.Generate", "rollout.types.RolloutBatch", "bytes"} <= set(grpo["forms"])
    assert "rollout.http.core.schemas.ChatCompletionRequest" in chat["forms"]
    for path in (grpo, chat):
        assert "engine-loop" in path["threads"] and "request_id" in path["id_names"]
        assert path["forms_in"] and path["forms_out"]
        assert not any(form.startswith(("inference.sched", "inference.runner")) for form in path["forms"])
