"""The EAGLE-3 head as a drafter: the target's passes capture the features (equal to transformers'
hidden states, compiled or not), training's parallel drafting equals drafting through the cache,
sd/exact with the head stay token-identical to ar (greedy) and follow the target's distribution
(sampling), viasd runs on the slim's features, and training improves agreement and resumes exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import FAMILIES, tiny_model
from support.head_cases import LAYERS, engine_with_head, make_head, prompt_for
from viasd_core.training import eagle_data, eagle_init, eagle_train, eagle_ttt
from viasd_core.training.shared import cosine_lr
from viasd_core.speculation import engine as engine_module
from viasd_core.speculation.draft_policy import DraftPolicy
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.router import OFF, Thresholds
from viasd_core.errors import UsageError
from viasd_core.speculation.sampling import SamplingParams, process_logits

NEW = 30


# ---------------------------------------------------------------------- features
@pytest.mark.parametrize("family", FAMILIES)
def test_captured_features_are_transformers_hidden_states(family):
    target = tiny_model(family, n_layers=5, seed=1)
    fast = FastModel(target, max_len=64)
    fast.capture_features(LAYERS)
    ids = torch.tensor(prompt_for(0, 20))
    fast.forward(ids[:13], 0, 1)  # a prefill, then token by token and a block
    for p in range(13, 16):
        fast.forward(ids[p : p + 1], p, 1)
    fast.forward(ids[16:20], 16, 4)
    with torch.no_grad():
        hs = target(ids[None], output_hidden_states=True).hidden_states
    expected = torch.cat([hs[l][0] for l in LAYERS], dim=-1)
    torch.testing.assert_close(fast.cache.features[:20], expected, atol=5e-4, rtol=1e-3)


def test_compiled_passes_capture_the_same_features():
    target = tiny_model("llama", n_layers=5, seed=2)
    ids = torch.tensor(prompt_for(1, 24))
    out = []
    for compiled in (False, True):
        fast = FastModel(target, max_len=64)
        fast.capture_features(LAYERS)
        if compiled:
            assert fast.compile()
        fast.forward(ids[:16], 0, 1)
        fast.forward(ids[16:17], 16, 1)
        fast.forward(ids[17:22], 17, 5)  # a padded verify pass (width 8)
        out.append(fast.cache.features[:22].clone())
    torch.testing.assert_close(out[1], out[0], atol=2e-4, rtol=1e-3)


def test_a_slim_model_captures_its_own_stream_at_the_nearest_run_layer():
    target = tiny_model("llama", n_layers=5, seed=3)
    slim = FastModel(target, layer_ids=[0, 2, 4], max_len=32)
    slim.capture_features((1, 2, 4))
    ids = torch.tensor(prompt_for(2, 8))
    slim.forward(ids, 0, 1)
    H = target.config.hidden_size
    # Layer 1 is skipped: its slot holds the state entering layer 2 (after run layers 0 only), the
    # same as the slot of layer 2 itself.
    torch.testing.assert_close(slim.cache.features[:8, :H], slim.cache.features[:8, H : 2 * H])
    with pytest.raises(ValueError):
        slim.capture_features((3, 1))


# ---------------------------------------------------------------------- training == drafting
def test_parallel_training_steps_equal_drafting_through_the_cache():
    target = tiny_model("llama", n_layers=5, seed=4)
    head = make_head(target, seed=4)
    ids = torch.tensor(prompt_for(3, 16))
    with torch.no_grad():
        hs = target(ids[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[l][0] for l in LAYERS], dim=-1)  # [16, 3H]
    T, steps = 15, 3
    with torch.no_grad():
        par = eagle_ttt.ttt_logits(head, ids[None], feats[None, :T], steps)
    for anchor in (0, 4, 9):
        # Drafting: catch up on the target's features up to the anchor, then feed own features with
        # the teacher's tokens (what training feeds).
        head.reset()
        logits, hidden = head.forward(ids[1 : anchor + 2], feats[: anchor + 1], 0, n_logits=1)
        torch.testing.assert_close(par[0][0, anchor], logits[0], atol=1e-4, rtol=1e-4)
        h = hidden[-1:]
        for s in range(1, steps):
            q = anchor + s
            logits, h = head.forward(ids[q + 1 : q + 2], h, q, n_logits=1)
            torch.testing.assert_close(par[s][0, q], logits[0], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- exactness in the engine
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["sd", "exact"])
def test_greedy_sd_and_exact_with_the_head_equal_ar(family, mode):
    target = tiny_model(family, n_layers=5, seed=5)
    head = make_head(target, seed=5)
    eng = engine_with_head(target, head, slim_layers=[0, 1, 3])
    for seed in range(3):
        prompt = prompt_for(seed)
        ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        for gamma in (1, 4):
            got = eng.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=gamma, adaptive=False))
            assert got.tokens == ar
            assert got.stats.draft_tokens > 0


def test_an_agreeing_head_is_accepted_and_the_hybrid_stays_exact():
    """A head trained on the target's own features agrees often: more than one token per target
    pass, token-identical to ar, alone and with prompt lookup."""
    target = tiny_model("llama", n_layers=5, seed=6)
    head, _, records = trained_head(target, steps=300)
    prompt = records[0].tokens[: records[0].prompt_len].tolist()  # a prompt whose answer it trained on
    for hybrid in (False, True):
        eng = engine_with_head(target, head, hybrid=hybrid)
        ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        got = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=3, adaptive=False))
        assert got.tokens == ar
        assert got.stats.new_tokens / got.stats.target_passes > 1.3


@pytest.mark.parametrize("hybrid", [False, True])
def test_the_head_catches_up_on_the_prompt_inside_the_prefill(hybrid):
    """The head's prompt positions run in the engine's prefill (timed there), not in the first
    speculative step's draft: the first block's draft re-runs one position, as any later one."""
    target = tiny_model("llama", n_layers=5, seed=6)
    eng = engine_with_head(target, make_head(target, seed=3), hybrid=hybrid)
    head = (eng.drafter.model_drafter if hybrid else eng.drafter).head
    prompt = list(range(3, 40))
    runs = []
    forward = head.forward

    def spy(token_ids, features, start, n_logits=None):
        runs.append((start, token_ids.shape[0]))
        return forward(token_ids, features, start, n_logits)

    head.forward = spy
    prefill = eng.drafter.prefill
    eng.drafter.prefill = lambda ids, n: (runs.append("prefill"), prefill(ids, n))
    got = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=8, gamma=2, adaptive=False))
    n = len(prompt)
    assert runs[:3] == ["prefill", (0, n - 2), (n - 2, 1)]  # the prompt but its last position, then that one
    assert got.tokens == eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=8)).tokens
    runs.clear()
    eng.reset()
    eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=8))
    assert runs == []  # plain decoding drafts nothing, and so prefills no drafter


def test_viasd_drafts_from_the_slim_features_where_the_target_did_not_run():
    target = tiny_model("llama", n_layers=5, seed=8)
    head = make_head(target, seed=8)
    eng = engine_with_head(target, head, slim_layers=[0, 1, 2, 3, 4])  # an all-layer slim: viasd is exact
    prompt = prompt_for(8)
    ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    used = []
    orig = eng.drafter._features

    def spy(start, end):
        used.append(end > eng.target.seen)
        return orig(start, end)

    eng.drafter._features = spy
    got = eng.generate(prompt, GenerationConfig(mode="viasd", max_new_tokens=NEW, gamma=3, adaptive=False,
                                                thresholds=Thresholds(accept=OFF, slim=0.0)))  # every token: slim tier
    assert got.tokens == ar
    assert any(used)  # some proposals read the slim's features (the target lagged behind)
    assert got.stats.draft_tokens > 0


@pytest.mark.parametrize("min_confidence,stop_on_device", [(0.0, False), (0.08, False), (0.08, True)])
def test_sampling_with_the_head_follows_the_target_distribution(min_confidence, stop_on_device):
    """Also with the confidence stop rule cutting blocks (it reads the draft's top probability,
    never the drawn token, so the cut cannot bias what is proposed), decided on the host or on the
    device (all gamma tokens drafted, positions past the cut no proposals)."""
    target = tiny_model("llama", n_layers=5, seed=9)
    head = make_head(target, seed=9, full=True)
    params = SamplingParams(temperature=1.0, top_k=20)
    prompt = prompt_for(9, 6)
    with torch.no_grad():
        first = process_logits(target(torch.tensor([prompt])).logits[0, -1:], params)[0]
    eng = engine_with_head(target, head)
    eng.drafter.stop_on_device = stop_on_device
    n = 1000
    counts = torch.zeros(256)
    accepted = drafted = 0
    for seed in range(n):
        out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=2, gamma=2, adaptive=min_confidence > 0,
                                                    min_confidence=min_confidence, temperature=1.0, top_k=20, seed=seed))
        counts[out.tokens[0]] += 1
        accepted += sum(out.stats.position_accepts)
        drafted += sum(out.stats.position_attempts)
    assert drafted > 0 and accepted < drafted  # rejections exercised
    tv = 0.5 * (counts / n - first).abs().sum()
    assert tv < 0.1  # sampling noise at n = 1000 is ~0.05
    assert (counts[first == 0] == 0).all()


class AlwaysDraft(DraftPolicy):
    """The adaptive policy without its wall-time guard: block lengths follow acceptance alone, so
    how much is drafted does not depend on how loaded the machine is."""

    def block_length(self) -> int:
        return self.gamma


def test_the_confidence_stop_rule_cuts_blocks_and_stays_exact(monkeypatch):
    monkeypatch.setattr(engine_module, "DraftPolicy", AlwaysDraft)
    target = tiny_model("qwen2", n_layers=5, seed=11)
    head = make_head(target, seed=11)
    eng = engine_with_head(target, head)
    prompt = prompt_for(11)
    ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    drafted = {}
    for conf in (0.0, 0.05, 0.9):
        eng.host_reads = 0
        got = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=4, min_confidence=conf))
        assert got.tokens == ar
        drafted[conf] = got.stats.draft_tokens
        if conf == 0.0:
            assert eng.host_reads == got.stats.steps  # no stop rule: the step's one read
        else:
            assert eng.host_reads >= got.stats.steps + got.stats.draft_tokens  # one read per drafted token
    assert drafted[0.9] < drafted[0.05] <= drafted[0.0], drafted


@pytest.mark.parametrize("mode", ["sd", "exact", "viasd"])
def test_the_confidence_stop_decided_on_the_device_needs_no_read_while_drafting(mode):
    """The stop rule decided on the device (the default off a CPU): all gamma tokens drafted, the
    proposals' count carried in the step's one read. Exact as the host rule, one read per step."""
    target = tiny_model("qwen2", n_layers=5, seed=11)
    head = make_head(target, seed=11)
    prompt = prompt_for(11)
    ar = engine_with_head(target, head).generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    # viasd with a slim view holding every layer, every token on the slim tier: the target's tokens
    th = Thresholds(accept=OFF, slim=0.0) if mode == "viasd" else None
    for on_device in (False, True):
        eng = engine_with_head(target, head, slim_layers=None if mode == "sd" else [0, 1, 2, 3, 4])
        eng.drafter.stop_on_device = on_device
        got = eng.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=4, min_confidence=0.05,
                                                    thresholds=th))
        assert got.tokens == ar, (mode, on_device)
        assert sum(got.stats.position_attempts) == got.stats.draft_tokens > 0  # proposals, not drafted tokens
        if on_device:
            assert eng.host_reads == got.stats.steps  # the step's one read, drafting included
        else:
            assert eng.host_reads >= got.stats.steps + got.stats.draft_tokens  # one read per drafted token


# ---------------------------------------------------------------------- training
def teacher_records(target, n=24, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        prompt = torch.randint(3, 256, (6,), generator=g).tolist()
        with torch.no_grad():
            out = target.generate(torch.tensor([prompt]), max_new_tokens=length, do_sample=False, pad_token_id=0)
        seqs.append((out[0].tolist(), len(prompt), "t"))
    return eagle_data.teacher_pass(target, seqs, LAYERS, batch_size=8)


def trained_head(target, steps, checkpoint=None, config=None):
    records = teacher_records(target)
    from viasd_core.training.teacher_answers import choose_vocab

    vocab_map = choose_vocab(records, 96)
    head = eagle_init.init_head(target, LAYERS, vocab_map, seed=0)
    config = config or eagle_train.HeadTrainConfig(steps=steps, batch_size=4, lr=3e-3, warmup=10, bf16=False,
                                                   checkpoint_every=10, eval_every=10 ** 9)
    log = eagle_train.train_head(head, records, config, checkpoint=checkpoint)
    head.allocate(256)
    return head, log, records


def test_training_fits_the_targets_choices_at_every_draft_position():
    """A random tiny target's continuations are chaotic (nothing to generalise; held-out agreement is
    measured on the real model, docs/distill.md): here training must fit them, position 2 included."""
    target = tiny_model("llama", n_layers=5, seed=6)
    head, log, records = trained_head(target, steps=300)
    before = eagle_ttt.evaluate_head(eagle_init.init_head(target, LAYERS, head_vocab(head)), records, steps=3)
    after = eagle_ttt.evaluate_head(head, records, steps=3)
    assert log["steps"] == 300
    assert log["losses"][-1]["loss"] < 0.8 * log["losses"][0]["loss"]
    for s in range(3):
        assert after["agreement"][s] > before["agreement"][s] + 0.2, (s, before, after)


def head_vocab(head):
    return head.to_target_ids(torch.arange(head.draft_vocab_size))


def test_training_resumes_from_its_checkpoint_exactly(tmp_path):
    """A run killed mid-way and resumed from its last checkpoint ends with the same weights."""
    target = tiny_model("llama", n_layers=5, seed=10)
    records = teacher_records(target, n=8)
    from viasd_core.training.teacher_answers import choose_vocab

    vocab_map = choose_vocab(records, 96)
    cfg = eagle_train.HeadTrainConfig(steps=20, batch_size=4, lr=3e-3, warmup=5, bf16=False, checkpoint_every=5,
                                      eval_every=12)

    def fresh():
        return eagle_init.init_head(target, LAYERS, vocab_map, seed=0)

    straight = fresh()
    eagle_train.train_head(straight, records, cfg)

    def killed(head):
        raise KeyboardInterrupt  # the session ends at step 12: the last checkpoint is step 10's

    ckpt = tmp_path / "head.ckpt"
    with pytest.raises(KeyboardInterrupt):
        eagle_train.train_head(fresh(), records, cfg, checkpoint=ckpt, eval_fn=killed)
    assert torch.load(ckpt, weights_only=True)["state"]["step"] == 10
    with pytest.raises(UsageError, match="trained towards 20 steps, not 30"):  # another schedule: refused
        eagle_train.train_head(fresh(), records, replace(cfg, steps=30), checkpoint=ckpt)
    resumed = fresh()
    log = eagle_train.train_head(resumed, records, cfg, checkpoint=ckpt)
    assert log["steps"] == 20
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_a_finished_training_extends_with_a_warm_restart_and_resumes_exactly(tmp_path):
    """`extend`: a finished run planned for fewer steps goes on (the learning rate warms up again and
    decays over the added steps); a run not finished is refused; an extension killed and resumed ends
    with the same weights as one that was not."""
    target = tiny_model("llama", n_layers=5, seed=10)
    records = teacher_records(target, n=8)
    from viasd_core.training.teacher_answers import choose_vocab

    vocab_map = choose_vocab(records, 96)
    cfg = eagle_train.HeadTrainConfig(steps=10, batch_size=4, lr=3e-3, warmup=2, bf16=False, checkpoint_every=5,
                                      eval_every=10 ** 9)
    more = replace(cfg, steps=20, lr=1e-3, extend=True)

    def fresh():
        return eagle_init.init_head(target, LAYERS, vocab_map, seed=0)

    def killed(head):
        raise KeyboardInterrupt  # the session ends at the first evaluation

    half = tmp_path / "half.ckpt"  # a run killed at step 5's evaluation: its last checkpoint is step 4's
    with pytest.raises(KeyboardInterrupt):
        eagle_train.train_head(fresh(), records, replace(cfg, eval_every=5, checkpoint_every=2), checkpoint=half,
                               eval_fn=killed)
    assert torch.load(half, weights_only=True)["state"]["step"] == 4
    with pytest.raises(UsageError, match="only a finished run can be extended"):
        eagle_train.train_head(fresh(), records, more, checkpoint=half)
    with pytest.raises(UsageError, match="trained towards 10 steps, not 20"):  # without extend: refused too
        eagle_train.train_head(fresh(), records, replace(more, extend=False), checkpoint=half)

    runs = {}
    for name in ("straight", "killed"):
        ckpt = tmp_path / f"{name}.ckpt"
        eagle_train.train_head(fresh(), records, cfg, checkpoint=ckpt)
        first = torch.load(ckpt, weights_only=True)["state"]
        assert first["step"] == 10 and "restarts" not in first
        head, lines = fresh(), []
        if name == "killed":  # killed at step 15's evaluation: the last checkpoint is step 14's
            with pytest.raises(KeyboardInterrupt):
                eagle_train.train_head(fresh(), records, replace(more, eval_every=5, checkpoint_every=2),
                                       checkpoint=ckpt, eval_fn=killed)
            assert torch.load(ckpt, weights_only=True)["state"]["step"] == 14
        log = eagle_train.train_head(head, records, more, checkpoint=ckpt, log=lines.append)
        assert log["steps"] == 20 and log["restarts"] == [10]
        state = torch.load(ckpt, weights_only=True)["state"]
        assert state["restarts"] == [10] and state["steps"] == 20
        runs[name] = (head, lines)
    lines = runs["straight"][1]
    assert any("a warm restart at step 10 towards 20 steps" in m for m in lines)
    last = [m for m in lines if m.startswith("step 20/20 ")][0]  # step 19's rate: the new cosine, 9 of 10 steps in
    assert float(last.split(" lr ")[1].split()[0]) == pytest.approx(cosine_lr(9, 10, 2, 1e-3), rel=0.05)  # printed to 2 digits
    for (name, a), b in zip(runs["straight"][0].state_dict().items(), runs["killed"][0].state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_the_schedule_restarts_at_an_extension():
    assert cosine_lr(0, 10, 2, 1e-3) == pytest.approx(5e-4)  # warm-up, step 1 of 2
    assert cosine_lr(10 - 10, 20 - 10, 2, 5e-4) == pytest.approx(2.5e-4)  # the extension warms up again
    assert cosine_lr(20 - 10, 20 - 10, 2, 5e-4) == pytest.approx(5e-5)  # and ends at a tenth of its peak


def test_the_compiled_head_step_drafts_as_the_eager_one_and_reads_no_stale_output():
    """The head's 1-token drafting step compiled (static shapes, the whole cache masked by position;
    CUDA graphs on CUDA): its logits equal the eager step's, and compiled sd under the CUDA-graph
    output stand-in still emits ar's tokens (the drafter keeps a copy of the step's output feature)."""
    from viasd_core.runtime import graph_outputs

    target = tiny_model("llama", n_layers=5, seed=13)
    head = make_head(target, seed=13)
    prompt = prompt_for(13)
    eager_eng = engine_with_head(target, head)
    ar = eager_eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    proposals = {"eager": [], "compiled": []}
    eager_eng.observers.append(lambda e, step: proposals["eager"].append(step.draft_tokens.tolist() if step.drafted else None))
    eager = eager_eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=3, adaptive=False))
    # one step by hand: the eager and the compiled step from the same cache
    feats = torch.randn(6, 3 * head.hidden_size, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor(prompt[:7])
    head.reset()
    _, hidden = head.forward(tokens[1:7], feats, 0)
    want, want_hidden = head.forward(tokens[6:7], hidden[-1:], 6, n_logits=1)
    assert head.compile()
    head.warm_up()
    head.forward(tokens[1:7], feats, 0)
    got, got_hidden = head.forward(tokens[6:7], hidden[-1:], 6, n_logits=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-4, atol=1e-4)
    eng = engine_with_head(target, head)
    assert eng.drafter.compile() and eng.drafter.warm_up() > 0
    eng.observers.append(lambda e, step: proposals["compiled"].append(step.draft_tokens.tolist() if step.drafted else None))
    with graph_outputs.checking():
        before = graph_outputs.checked
        got_run = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=3, adaptive=False))
        assert graph_outputs.checked - before >= got_run.stats.draft_tokens - got_run.stats.steps  # compiled steps ran
    assert got_run.tokens == ar == eager.tokens
    assert got_run.stats.draft_tokens == eager.stats.draft_tokens
    assert proposals["compiled"] == proposals["eager"] and len(proposals["eager"]) > 3  # the same proposals
