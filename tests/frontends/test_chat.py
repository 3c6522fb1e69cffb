"""`viasd chat`: a scripted session through the real app (piped stdin), and the conversation
logic of viasd_core.frontends.chat: KV-cache re-use across turns equals re-processing the whole history."""

import json

import pytest
from typer.testing import CliRunner

from conftest import positions_run, record_forward
from viasd_cli.app import get_app
from viasd_core.frontends.chat import Chat
from viasd_core.frontends.chat_commands import parse_command, run_command
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.loading.profile import Profile, profile_path, save_profile
from viasd_core.session import build_session
from viasd_core.loading.options import ModelOptions

N = 6  # new tokens per answer: several verification passes, still fast on a busy CPU


def run_chat(tiny_dirs, *args, input=None):
    argv = ["chat", "-m", str(tiny_dirs["target"]), "-d", str(tiny_dirs["draft"]), "-n", str(N), *map(str, args)]
    return CliRunner().invoke(get_app(), argv, input=input)


def make_chat(tiny_dirs, mode="sd", draft="draft", **config):
    opts = ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs[draft]) if draft else None)
    session = build_session(opts, mode=mode)
    return Chat(session, GenerationConfig(mode=mode, max_new_tokens=N, **config))


def test_scripted_session(tiny_dirs, viasd_home, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    script = "\n".join([
        "w1 w2 w3",
        "/mode ar",
        "w4 w5",
        "/gamma 0",
        "/gamma 3",
        "/temp -1",
        "/temp 0.5",
        "/mode fast",
        "/frobnicate",
        "/system w9 w9",
        "/mode sd",
        "w6",
        "/stats",
        f"/save {blocker}/chat.json",
        f"/save {tmp_path}/chat.json",
        "/exit",
        "w7 never sent",
    ]) + "\n"
    r = run_chat(tiny_dirs, "--seed", "1", input=script)
    assert r.exit_code == 0, r.stderr
    # stdout: the three answers only, one line each, plain text
    answers = r.stdout.splitlines()
    assert len(answers) == 3 and all(a.strip() for a in answers), r.stdout
    assert "\x1b" not in r.stdout and "\x1b" not in r.stderr
    assert "tok/s" not in r.stdout and "Session" not in r.stdout
    err = r.stderr
    for message in ("gamma must be at least 1 (got 0)", "temperature must be >= 0", "unknown mode 'fast'",
                    "unknown command '/frobnicate'", "mode ar", "gamma 3", "temperature 0.5", "system message set",
                    "cannot write", f"saved 3 turns to {tmp_path}/chat.json", "chat statistics", "Session: 3 turns"):
        assert message in err, (message, err)
    assert err.count("[sd] ") == 2 and err.count("[ar] ") == 1

    saved = json.loads((tmp_path / "chat.json").read_text())
    assert not (blocker / "chat.json").exists()
    assert saved["version"] == 1 and saved["draft"] != "none"
    turns = saved["turns"]
    assert [t["mode"] for t in turns] == ["sd", "ar", "sd"]
    # the first block measured on this machine (no -g), then /gamma 0 refused and changing nothing
    assert 2 <= turns[0]["gamma"] == turns[1]["gamma"] <= 5 and turns[2]["gamma"] == 3
    assert [t["temperature"] for t in turns] == [0.0, 0.0, 0.5]
    assert [t["user"] for t in turns] == ["w1 w2 w3", "w4 w5", "w6"]
    assert [t["assistant"] for t in turns] == answers
    for t in turns:
        assert 1 <= t["new_tokens"] <= N and t["new_tokens"] == t["stats"]["new_tokens"] == len(t["tokens"])
        assert t["reused_tokens"] + t["processed_tokens"] == t["prompt_tokens"]
        assert set(t["stats"]["tier_shares"]) == {"accept", "slim", "full", "bonus"}
    assert turns[0]["reused_tokens"] == 0
    # Turn 2 extends turn 1: everything but its newest tokens comes from the cache.
    assert turns[1]["reused_tokens"] >= turns[0]["prompt_tokens"] + turns[0]["new_tokens"] - 1
    assert turns[1]["processed_tokens"] < turns[1]["prompt_tokens"] // 2
    # The system message changes the first tokens of the conversation: nothing re-usable.
    assert turns[2]["reused_tokens"] == 0
    assert saved["system"] == "w9 w9"
    assert [m["role"] for m in saved["messages"]] == ["system"] + ["user", "assistant"] * 3
    totals = saved["totals"]
    assert totals["turns"] == 3
    assert totals["reused_tokens"] == sum(t["reused_tokens"] for t in turns)
    assert totals["stats"]["new_tokens"] == sum(t["new_tokens"] for t in turns)
    reused, processed = totals["reused_tokens"], totals["processed_tokens"]
    assert f"prefill {reused} tokens re-used from cache, {processed} processed" in err


def test_model_that_fails_to_load(tiny_dirs, viasd_home, tmp_path):
    r = CliRunner().invoke(get_app(), ["chat", "-m", str(tmp_path / "missing")], input="w1\n")
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_parse_command():
    assert parse_command("/gamma 4") == ("gamma", "4")
    assert parse_command("  /SYSTEM be brief  ") == ("system", "be brief")
    assert parse_command("/stats") == ("stats", "")
    assert parse_command("hello /gamma") is None
    assert parse_command("//etc/passwd is a path") is None  # '//' escapes a leading slash


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_cache_reuse_equals_reprocessing_the_history(tiny_dirs, viasd_home, mode):
    chat = make_chat(tiny_dirs, mode=mode)
    for text in ("w1 w2 w3 w4", "w5 w6", "w7 w8 w9"):
        chat.ask(text)
    fresh = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])), mode=mode).engine
    for k, turn in enumerate(chat.turns):
        ids = chat.encode(chat.messages[: 2 * k + 1])
        assert len(ids) == turn.prompt_tokens
        fresh.reset()
        again = fresh.generate(ids, GenerationConfig(mode=mode, max_new_tokens=N))
        assert again.tokens == turn.tokens, k
        if k:
            # The WordLevel template re-encodes the answers exactly: nothing but the newest prompt tokens ran.
            assert turn.mismatch_tokens == 0
            assert turn.reused_tokens == chat.turns[k - 1].prompt_tokens + chat.turns[k - 1].new_tokens - 1
            assert turn.processed_tokens == turn.prompt_tokens - turn.reused_tokens


def test_reencoded_history_is_measured_not_assumed(tiny_dirs, viasd_home):
    chat = make_chat(tiny_dirs)
    first = chat.ask("w1 w2 w3 w4")
    # As if the template had re-encoded the answer differently from the generated ids.
    chat.messages[1]["content"] = "w200 " + chat.messages[1]["content"]
    second = chat.ask("w5")
    ids_first = chat.encode(chat.messages[:1])
    assert second.reused_tokens == len(ids_first)  # the cache is good up to the answer, not beyond
    assert second.mismatch_tokens == first.new_tokens
    assert second.processed_tokens == second.prompt_tokens - second.reused_tokens


def test_interrupt_keeps_the_partial_answer_and_a_consistent_cache(tiny_dirs, viasd_home):
    chat = make_chat(tiny_dirs, mode="ar")
    chat.config.max_new_tokens = 12
    seen = []

    def stop_after_three(tokens, tiers):
        seen.extend(tokens)
        if len(seen) >= 3:
            raise KeyboardInterrupt

    turn = chat.ask("w1 w2 w3", on_emit=stop_after_three)
    assert turn.finish_reason == "interrupted" and turn.tokens == seen[:3] == seen
    assert chat.messages[-1] == {"role": "assistant", "content": turn.assistant}
    chat.config.max_new_tokens = N
    nxt = chat.ask("w4 w5")
    assert nxt.finish_reason in ("eos", "length") and nxt.reused_tokens > 0
    fresh = build_session(ModelOptions(model=str(tiny_dirs["target"])), mode="ar").engine
    again = fresh.generate(chat.encode(chat.messages[:3]), GenerationConfig(mode="ar", max_new_tokens=N))
    assert again.tokens == nxt.tokens


def test_commands_and_viasd_mode_with_a_profile(tiny_dirs, viasd_home, tmp_path):
    chat = make_chat(tiny_dirs)
    reply = run_command(chat, "/mode viasd")
    assert reply.kind == "error" and "viasd calibrate" in reply.text and chat.config.mode == "sd"
    s = chat.session
    save_profile(Profile(target_id=s.target.model_id, draft_id=s.draft_id, quant="none", device="cpu", dtype="float32",
                         layer_ids=[0, 1], n_layers=4, theta_accept=0.9, theta_slim=0.6, budget=0.05,
                         heldout_fidelity=0.97), profile_path(s.target.model_id, s.draft_id, "none", "cpu"))
    assert run_command(chat, "/temp 0.7").kind == "info"
    assert run_command(chat, "/mode viasd").kind == "error" and chat.config.mode == "sd"  # greedy-only
    assert run_command(chat, "/temp 0").kind == "info"
    reply = run_command(chat, "/mode viasd")
    assert reply.kind == "info" and "fidelity budget >= 0.950" in reply.text and chat.config.mode == "viasd"
    meter = chat.meter()
    turn = chat.ask("w1 w2 w3", meter=meter)
    assert turn.mode == "viasd" and turn.fidelity is not None and 0 <= turn.fidelity <= 1
    assert meter.tokens == turn.new_tokens and sum(meter.tier_counts.values()) == turn.new_tokens
    assert meter.passes == turn.stats.target_passes
    fields = dict((label, value) for value, label in meter.fields())
    assert fields["fidelity budget"] == ">= 0.950" and fields["tok"] == str(turn.new_tokens)
    assert run_command(chat, "/temp 0.5").kind == "error" and chat.config.temperature == 0  # viasd: greedy-only
    assert run_command(chat, "/gamma x").kind == "error" and run_command(chat, "/save").kind == "error"
    reply = run_command(chat, "/gamma 3")  # adaptive: the first block, then up to the cap
    assert reply.text == "gamma 3 (adaptive: the first block; then it follows acceptance, up to 12)"
    assert chat.config.gamma == 3 and chat.config.gamma_max == 12
    assert run_command(chat, "/reset").kind == "info" and chat.messages == [] and chat.engine.tokens == []
    assert run_command(chat, "/help").kind == "help" and run_command(chat, "/exit").kind == "exit"
    again = chat.ask("w1 w2 w3")
    assert again.conversation == 2 and again.reused_tokens == 0 and again.tokens == turn.tokens


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_prefill_counts_are_what_the_target_ran(tiny_dirs, viasd_home, mode):
    chat = make_chat(tiny_dirs, mode=mode)
    calls = record_forward(chat.engine.target)
    first = chat.ask("w1 w2 w3 w4")
    ran = positions_run(calls, first.prompt_tokens)
    assert sorted(ran) == list(range(first.prompt_tokens))  # each prompt position once
    assert (first.reused_tokens, first.processed_tokens) == (0, first.prompt_tokens)
    calls.clear()
    second = chat.ask("w5 w6")
    ran = positions_run(calls, second.prompt_tokens)
    # The second turn re-used the first turn's cache: the target ran only the positions after it.
    assert second.reused_tokens > first.prompt_tokens
    assert sorted(ran) == list(range(second.reused_tokens, second.prompt_tokens))
    assert second.processed_tokens == len(ran)
    assert second.stats.prefill_cached == second.reused_tokens and second.stats.prefill_processed == len(ran)


def test_prefill_counts_when_the_conversation_outgrows_the_context(tiny_dirs, viasd_home):
    """A conversation that outgrows the context drops its oldest turns; the caches are allocated
    once and never re-allocated, and the counts say exactly which prompt positions the target ran."""
    from viasd_core.speculation.engine import Engine
    from viasd_core.runtime.model import FastModel

    chat = make_chat(tiny_dirs, mode="ar", draft=None)
    small = chat.engine
    chat.engine = Engine(FastModel(small.target.hf_model, max_len=48), small.tokenizer, eos_token_ids=small.eos)
    calls = record_forward(chat.engine.target)
    first = chat.ask("w1 w2 w3")
    assert first.reused_tokens == 0 and chat.engine.target.max_len == 48
    calls.clear()
    second = chat.ask(" ".join(f"w{i}" for i in range(10, 40)))
    assert second.dropped_messages > 0  # the first exchange no longer fits
    assert chat.engine.target.max_len == 48  # allocated once: never re-allocated
    ran = positions_run(calls, second.prompt_tokens)
    assert sorted(ran) == list(range(second.reused_tokens, second.prompt_tokens))
    assert second.reused_tokens + second.processed_tokens == second.prompt_tokens
    assert (second.stats.prefill_cached, second.stats.prefill_processed) == (second.reused_tokens, second.processed_tokens)


def test_three_turns_compile_once_and_the_draft_reads_only_new_tokens(tiny_dirs, viasd_home, monkeypatch):
    """The live meter watches steps as an engine observer: no drafter is swapped in per turn, so a
    compiled chat compiles once and every cache (the draft's too) is kept across turns."""
    from viasd_core.runtime.model import FastModel

    compiles = []
    monkeypatch.setattr(FastModel, "compile", lambda self, mode=None: compiles.append(self.name) or False)
    chat = make_chat(tiny_dirs, mode="sd", gamma=3, adaptive=False)
    chat.engine.compile()
    compiled_at_start = len(compiles)
    assert compiled_at_start == 2  # target and draft
    draft = chat.engine.drafter.fast_models()[0]
    calls = record_forward(draft)
    for i, text in enumerate(("w1 w2 w3", "w4 w5", "w6")):
        calls.clear()
        meter = chat.meter()
        turn = chat.ask(text, meter=meter)
        # The draft's first pass of the turn starts where the re-used conversation ends (at most
        # two positions behind: its cache may lag the target's by the last step's tokens); the
        # history before it is not read again.
        first_start = calls[0][0]
        if i:
            assert turn.reused_tokens > 0 and turn.reused_tokens - 2 <= first_start <= turn.reused_tokens
        assert positions_run(calls, turn.prompt_tokens) == list(range(first_start, turn.prompt_tokens))
        # The meter, fed by the engine's step results, counts what the run's statistics count.
        assert meter.drafted == turn.stats.draft_tokens > 0
        assert meter.kept == sum(turn.stats.position_accepts)
    assert len(compiles) == compiled_at_start  # no recompilation in any turn
