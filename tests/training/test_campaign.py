"""The head's training campaign (viasd_core/training/campaign.py) on a tiny random target: every stage
resumes after a kill and ends as an uninterrupted run does; the prompt filters; the stored data
round-trips; compacted batched generation equals the plain one; on-policy rejections weight the loss
where they happened."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import save_tiny_model_dir, tiny_model
from transformers import AutoModelForCausalLM

from viasd_core.speculation.eagle_files import save_feature_head
from viasd_core.errors import UsageError
from viasd_core.loading.models import load_model
from viasd_core.loading.prompts import load_prompts
from viasd_core.runtime.weight_format import INT4
from viasd_core.training import campaign_store as store
from viasd_core.training import eagle_data, eagle_init, eagle_train, eagle_ttt, teacher_answers
from viasd_core.training.campaign import CampaignConfig, run_campaign, status
from viasd_core.training.campaign_answers import AnswerConfig
from viasd_core.training.campaign_eval import EvalConfig, better
from viasd_core.training.campaign_prompts import PromptConfig, RequestRound, run_prompt_stage
from viasd_core.training.campaign_train import TrainConfig, rejection_focus
from viasd_core.training.on_policy import OnPolicyConfig
from viasd_core.training.prompt_filter import evaluation_index, normalise, select
from viasd_core.training.prompt_requests import Request, build_requests, parse_reply

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["What", "Why", "How", "is", "the", "a", "of", "?", ".", "bees", "water", "Translate", "text"] + \
        [f"w{i}" for i in range(235)]


# ---------------------------------------------------------------------- prompts
def test_near_duplicates_go_and_the_first_of_each_stays():
    long = "Write a short blog post about urban gardening for beginners who live in small flats in big cities"
    candidates = [
        long,
        long.upper() + "!!",  # the same text, normalised
        long.replace("beginners", "newcomers"),  # one word changed: near
        "Write a short blog post about jazz music for beginners who play the piano",  # same template, new topic
        "Translate German to English: Das Wetter ist heute schön.",
        "Translate German to English: Der Zug fährt um acht Uhr ab.",
    ]
    kept, dropped = select(candidates, evaluation_index([]))
    assert kept == [0, 3, 4, 5]
    assert dropped == {"evaluation": 0, "duplicate": 2}


def test_nothing_near_an_evaluation_prompt_is_kept():
    dev = [json.loads(line)["turns"][0] for line in (ROOT / "docs/results/cpu-prompts.jsonl").read_text().splitlines()]
    index = evaluation_index(dev)
    assert all(index.near(p) for p in dev)
    quoted = "Please help me with this: " + dev[0]
    words = dev[18].split()  # a summarization article: a copied sentence of it is enough
    copied = "Summarize: " + " ".join(words[40:52]) + " and then the bridge opened."
    reworded = normalise(dev[0]).upper()
    unrelated = ["Write a haiku about bees.", "What is 12 times 7?", "Translate French to English: Je suis ici."]
    kept, dropped = select([quoted, copied, reworded] + unrelated, index)
    assert kept == [3, 4, 5] and dropped["evaluation"] == 3


def test_replies_become_prompts_or_are_refused():
    q = Request("qa", "{text}", meta="m", parse="question")
    assert parse_reply(q, 'A curious student might ask, "How does a volcano create magma?"') == "How does a volcano create magma?"
    assert parse_reply(q, "The answer: Variety of sports, Fashion") is None  # no question
    p = Request("summarization", "Summarize: {text}", meta="m", parse="passage")
    text = ("Honeybees live in large colonies inside hollow trees or wooden hives kept by farmers. Each colony has "
            "one queen, a few hundred drones and thousands of workers. Workers collect nectar and pollen from "
            "flowers within a few kilometres and turn the nectar into honey! In winter the bees cluster together "
            "to stay warm. The queen lays")
    assert parse_reply(p, text) == "Summarize: " + text[: text.rindex(".") + 1].strip()  # cut to whole sentences
    assert parse_reply(p, "amix" * 200) is None  # a loop
    c = Request("coding", "{text}\n\nExplain what this code does.", meta="m", parse="code")
    code = "```python\ndef f(x):\n    return x[::-1]\n```\nExample: f('ab')"
    assert parse_reply(c, code) == "def f(x):\n    return x[::-1]\n\nExplain what this code does."
    first = build_requests(50, seed=3)
    assert first == build_requests(50, seed=3) and first != build_requests(50, seed=4)
    assert len({r.category for r in build_requests(400)}) == 13


# ---------------------------------------------------------------------- stored data
@pytest.mark.parametrize("vocab", [49152, 100_000])
def test_sequence_shards_round_trip(tmp_path, vocab):
    g = np.random.default_rng(0)
    seqs = [g.integers(0, vocab, n) for n in (5, 1, 17)]
    shard = store.SequenceShard(seqs, [2, 1, 9], [10, 11, 12])
    shard.save(tmp_path / "s.npz", vocab)
    back = store.SequenceShard.load(tmp_path / "s.npz")
    assert [s.tolist() for s in back.sequences] == [s.tolist() for s in seqs]
    assert back.prompt_lens == [2, 1, 9] and back.prompt_index == [10, 11, 12]
    assert back.generated == 3 + 0 + 8
    assert store.load_npz(tmp_path / "s.npz")["tokens"].dtype == (np.uint16 if vocab <= 65536 else np.int32)


def test_feature_shards_round_trip_bit_exact(tmp_path):
    feats = torch.randn(7, 12).to(torch.bfloat16)
    ids, logp = torch.randint(0, 300, (7, 4)), torch.randn(7, 4)
    store.save_feature_shard(tmp_path / "f", feats, ids, logp)
    f, i, lp = store.FeatureShard(tmp_path / "f").rows(2, 6)
    assert f.dtype == torch.bfloat16 and torch.equal(f, feats[2:6]) and torch.equal(i, ids[2:6]) and torch.equal(lp, logp[2:6])
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # no temporary folder left


# ---------------------------------------------------------------------- generation and loss
def test_compacted_generation_equals_the_plain_one():
    """Rows that end leave the batch (the fast path); the greedy outputs stay those of the plain loop."""
    target = tiny_model("llama", seed=4)
    prompts = [[1, 5, 6, 7, 8, 9], [1, 11, 12], [1, 40, 41, 42, 43], [1, 90]]
    plain = teacher_answers.generate_batch(target, prompts, 12, eos_ids=set(), pad_id=0, compact=False)
    eos = {plain[0][0][3], plain[2][0][7]}  # rows 0 and 2 end early
    fast = teacher_answers.generate_batch(target, prompts, 12, eos_ids=eos, pad_id=0)
    ref = teacher_answers.generate_batch(target, prompts, 12, eos_ids=eos, pad_id=0, compact=False)
    assert fast == ref
    assert min(len(t) for t, _ in fast) < 12 and max(len(t) for t, _ in fast) == 12


def test_rejections_weight_the_loss_where_the_draft_failed():
    focus = rejection_focus({"sd-00000": [(0, 7, 0), (0, 9, 2), (1, 4, 5)]}, steps=3, boost=4.0)
    w = focus("sd-00000", 0, 12)
    assert w[5, 0] == 5 and w[7, 2] == 5 and w.sum() == 12 * 3 + 8  # token t, draft j -> head position t - 2, step j
    assert torch.equal(focus("sd-00000", 1, 6), torch.ones(6, 3))  # draft 5 is past the trained steps
    target = tiny_model("llama", n_layers=4, seed=2)
    seqs = [(torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(i)).tolist(), 6, "") for i in range(2)]
    recs = eagle_data.teacher_pass(target, seqs, (1, 2, 3))
    head = eagle_init.init_head(target, (1, 2, 3), torch.arange(256))
    index = eagle_train.draft_index(head)
    plain, _ = eagle_ttt.ttt_loss(head, recs, index, 3)
    ones, _ = eagle_ttt.ttt_loss(head, [replace(r, focus=torch.ones(20, 3)) for r in recs], index, 3)
    torch.testing.assert_close(plain, ones)
    only = torch.zeros(20, 3)
    only[10, 0] = 1.0  # one position of step 0 alone: its soft cross-entropy, and nothing from steps 1-2
    one, _ = eagle_ttt.ttt_loss(head, [replace(recs[0], focus=only)], index, 3)
    logp = torch.log_softmax(eagle_ttt.ttt_logits(head, recs[0].tokens[None, :20], recs[0].features[None, :19], 1)[0][0, 10], -1)
    probs, idx = eagle_ttt.soft_targets([recs[0]], index, 19)
    torch.testing.assert_close(one, -(probs[0, 10] * logp[idx[0, 10]]).sum())



def _loss_over_every_row(head, records, index, steps, decay=0.8):
    """The plain loss: logits on every head position, the rows without a label masked out."""
    tokens, feats, T = eagle_ttt.make_batch(records, 512)
    probs, idx = eagle_ttt.soft_targets(records, index, T)
    focus = eagle_ttt.focus_weights(records, T, steps)
    total = 0.0
    for s, lg in enumerate(eagle_ttt.ttt_logits(head, tokens, feats, steps)):
        logp = torch.log_softmax(lg[:, s:].float(), dim=-1).gather(-1, idx[:, s:])
        w = (probs[:, s:].sum(-1) > 0) * focus[:, s:, s]
        total = total + decay ** s * (-(probs[:, s:] * logp).sum(-1) * w).sum() / w.sum().clamp(min=1)
    return total


def test_the_loss_computes_logits_only_where_there_are_labels_and_equals_the_plain_loss():
    target = tiny_model("llama", n_layers=4, seed=3)
    # a prompt of one token (labels from position 0), long prompts, a record that is all prompt but one token
    shapes = [(1, 12), (9, 5), (14, 2), (4, 9)]
    g = torch.Generator().manual_seed(4)
    seqs = [(torch.randint(3, 256, (p + a,), generator=g).tolist(), p, "") for p, a in shapes]
    recs = eagle_data.teacher_pass(target, seqs, (1, 2, 3))
    focus = torch.ones(16, 3)
    focus[6, 1] = 5.0
    recs[1] = replace(recs[1], focus=focus)
    head = eagle_init.init_head(target, (1, 2, 3), torch.arange(200))  # some labels outside the draft vocabulary
    index = eagle_train.draft_index(head)
    fast, acc = eagle_ttt.ttt_loss(head, recs, index, 3)
    fast_grads = torch.autograd.grad(fast, [head.fc.weight, head.lm_head.weight])
    plain = _loss_over_every_row(head, recs, index, 3)
    plain_grads = torch.autograd.grad(plain, [head.fc.weight, head.lm_head.weight])
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eagle_ttt.ttt_loss(head, recs, index, 3, rows_only=False)[0], plain, atol=1e-5, rtol=1e-5)
    for a, b in zip(fast_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert len(acc) == 3 and all(0.0 <= a <= 1.0 for a in acc)
    tokens, feats, T = eagle_ttt.make_batch(recs, 512)
    labelled = eagle_ttt.soft_targets(recs, index, T)[0].sum(-1) > 0
    rows = eagle_ttt.ttt_logits(head, tokens, feats, 1, rows=labelled)[0]
    assert rows.shape == (int(labelled.sum()), head.draft_vocab_size) and rows.shape[0] < 4 * T  # prompt rows skipped
    torch.testing.assert_close(rows, eagle_ttt.ttt_logits(head, tokens, feats, 1)[0][labelled])


# ---------------------------------------------------------------------- the campaign, killed and resumed
@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("campaign") / "target", words=WORDS, seed=5)


def tiny_config(target: Path, root: Path, files: Path) -> CampaignConfig:
    t = TrainConfig(draft_vocab=64, held_out_eval=4)
    fast = dict(batch_size=4, lr=3e-3, warmup=2, bf16=False, checkpoint_every=3, ttt_steps=2)
    return CampaignConfig(
        target=str(target), data=root / "data", work=root / "work", held_out_every=5, teacher_batch_size=4,
        prompts=PromptConfig(requests=16, shard_size=8, batch_size=8, extra=[files / "extra.jsonl"],
                             evaluation=[files / "dev.jsonl"]),
        answers=AnswerConfig(max_new_tokens=10, shard_size=5, batch_size=4),
        train=replace(t, data=eagle_train.HeadTrainConfig(steps=8, eval_every=4, **fast),
                      on_policy=eagle_train.HeadTrainConfig(steps=5, eval_every=4, **fast)),
        on_policy=OnPolicyConfig(max_new_tokens=10),
        evaluation=EvalConfig(prompts=files / "dev.jsonl", answer_tokens=8, tau_tokens=8, max_context=256, positions=2),
        ship_to=root / "shipped")


KILLS = [  # one kill at the first log line matching each, in order: mid-shard, between shards, mid-training
    r"^prompts raw shard 1/2: \d+/\d+ replies", r"^prompts raw shard 2/2: \d+/8 usable", r"^answers greedy shard 2/\d+: \d+/5$",
    r"^answers sampled shard 1/\d+: \d+ tokens in", r"^features greedy-00001: \d+/5 sequences", r"^features sampled-00000 ",
    r"^step 4: held-out", r"^on-policy shard 1/\d+:", r"^step 4: held-out", r"^eval data",
]


def _files(folder: Path) -> dict[str, object]:
    """Every file under `folder`: arrays for .npz (their zip headers hold a time), bytes otherwise."""
    out: dict[str, object] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = ({k: v.tolist() for k, v in store.load_npz(p).items()}
                                               if p.suffix == ".npz" else p.read_bytes())
    return out


def test_every_stage_resumes_after_a_kill_and_ends_as_an_uninterrupted_run(tiny_target, tmp_path, viasd_home):
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps({"category": c, "prompt": p}) + "\n" for c, p in
                                               [("qa", "What is the w3 of w4 ?"), ("writing", "Write a haiku about bees .")]))
    (tmp_path / "extra.jsonl").write_text("".join(json.dumps({"category": "text", "prompt": f"w{i} w{i + 1} w{2 * i} ?"}) + "\n"
                                                 for i in range(10, 20)))
    straight = tiny_config(tiny_target, tmp_path / "a", tmp_path)
    killed = tiny_config(tiny_target, tmp_path / "b", tmp_path)
    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    for cfg in (straight, killed):  # the shipped head: the same fresh one in both
        save_feature_head(eagle_init.init_head(target, (1, 2, 3), torch.arange(0, 256, 4), seed=9), cfg.ship_to)
    report = run_campaign(straight)

    pending = list(KILLS)

    def log(msg: str) -> None:
        if pending and re.search(pending[0], msg):
            pending.pop(0)
            raise KeyboardInterrupt(msg)

    kills = 0
    while True:
        try:
            resumed = run_campaign(killed, log=log)
            break
        except KeyboardInterrupt:
            kills += 1
    assert pending == [] and kills == len(KILLS), pending
    files = _files(straight.data)
    assert files.keys() == _files(killed.data).keys()
    for name, content in _files(killed.data).items():  # prompts, answers
        if name != "eval-report.json":  # its default-policy tau follows wall times
            assert content == files[name], name
    assert _files(straight.work / "on_policy") == _files(killed.work / "on_policy")  # the same rejections
    assert len(_files(killed.work / "on_policy")) == len(list((killed.data / "answers").glob("greedy-*.npz")))
    for name in ("data", "on_policy"):  # the same weights (config.json also holds wall times)
        a, b = (cfg.work / "heads" / name / "model.safetensors" for cfg in (straight, killed))
        assert a.read_bytes() == b.read_bytes(), name
    for name in ("data", "on_policy", "shipped"):
        one = report["candidates"].get(name) or report["shipped"]
        other = resumed["candidates"].get(name) or resumed["shipped"]
        assert one["agreement"] == other["agreement"] and one["tau_fixed"] == other["tau_fixed"], name
        assert one["tau_fixed"]["target_passes"] > 0
    assert set(report["candidates"]) == {"data", "on_policy"} and "shipped" in report
    for name in ("data", "on_policy"):  # trained on the float32 target's data, and say so
        assert json.loads((straight.work / "heads" / name / "config.json").read_text())["viasd_training"]["target_format"] == "none"
    assert not (straight.data / "campaign.json").exists() and not (straight.work / "campaign.json").exists()
    for figures in [*report["candidates"].values(), report["shipped"]]:  # every head, in the one interleaved loop
        assert figures["tau_default"]["target_passes"] > 0 and figures["tau_default"]["new_tokens"] == 2 * 8
    assert report["decision"] in ("ship data", "ship on_policy", "keep the shipped head")
    assert report["target_format"] == "none"  # measured on the float32 target, under the first campaigns' names
    assert (straight.work / "eval" / "features.pt").exists() and not list((straight.work / "eval").glob("features-*"))
    assert {json.loads(p.read_text())["target_format"] for p in (straight.work / "eval").glob("*.json")} == {"none"}
    lines = status(killed)
    assert lines[0].startswith("prompts: 2/2 request shards") and lines[-1] == "eval: done", lines

    # without the on-policy stage: the data head alone is measured against the shipped one
    alone = replace(straight, data=tmp_path / "c" / "data", work=tmp_path / "c" / "work", ship_to=tmp_path / "c" / "shipped",
                    on_policy_stage=False)
    shutil.copytree(straight.data, alone.data)
    shutil.copytree(straight.ship_to, alone.ship_to)
    (alone.data / "eval-report.json").unlink()
    alone.work.mkdir()
    for part in ("features", "train", "heads"):
        shutil.copytree(straight.work / part, alone.work / part)
    shutil.rmtree(alone.work / "heads" / "on_policy")
    (alone.work / "train" / "on_policy.ckpt").unlink()
    logs: list[str] = []
    only = run_campaign(alone, log=logs.append)
    assert set(only["candidates"]) == {"data"} and "on_policy: skipped (on_policy_stage is off)" in logs
    assert only["candidates"]["data"]["agreement"] == report["candidates"]["data"]["agreement"]
    assert not (alone.work / "on_policy").exists() and not (alone.work / "heads" / "on_policy").exists()
    assert status(alone)[-1] == "eval: done"
    # a cached measurement holds for its weights only: other weights under the same name are measured again
    save_feature_head(eagle_init.init_head(target, (1, 2, 3), torch.arange(0, 256, 2), seed=11), alone.ship_to)
    logs.clear()
    again = run_campaign(alone, log=logs.append)
    assert any(m.startswith("eval shipped:") for m in logs) and not any(m.startswith("eval data:") for m in logs)
    assert again["shipped"]["weights_sha256"] != only["shipped"]["weights_sha256"]
    assert again["candidates"]["data"] == only["candidates"]["data"]
    # ... and for the measuring code it records: a figure from an older one is measured again; one cached
    # before the format was recorded was measured on the float32 target, and stays valid
    cached = alone.work / "eval" / "data.json"
    cached.write_text(json.dumps({**json.loads(cached.read_text()), "measured_with": 1}))
    unrecorded = alone.work / "eval" / "shipped.json"
    unrecorded.write_text(json.dumps({k: v for k, v in json.loads(unrecorded.read_text()).items() if k != "target_format"}))
    logs.clear()
    run_campaign(alone, log=logs.append)
    assert any(m.startswith("eval data:") for m in logs) and not any(m.startswith("eval shipped:") for m in logs)
    assert "target_format" not in json.loads(unrecorded.read_text())
    assert any(m.startswith("eval: default tau, every head in one interleaved loop: data ") for m in logs)

    # a finished data training extended (a warm restart): the head it had made stays as data-<steps>,
    # and what the on-policy stage made from it is set aside
    before = (alone.work / "heads" / "data" / "model.safetensors").read_bytes()
    shutil.copytree(straight.work / "heads" / "on_policy", alone.work / "heads" / "on_policy")
    longer = replace(alone, train=replace(alone.train, data=replace(alone.train.data, steps=12, extend=True)))
    logs.clear()
    run_campaign(longer, log=logs.append)
    assert (alone.work / "heads" / "data-8" / "model.safetensors").read_bytes() == before
    assert not (alone.work / "heads" / "on_policy").exists()
    assert (alone.work / "on_policy-from-data-8" / "on_policy" / "model.safetensors").exists()
    assert any("a warm restart at step 8 towards 12 steps" in m for m in logs)
    assert torch.load(alone.work / "train" / "head.ckpt", weights_only=True)["state"]["step"] == 12
    assert status(longer)[3] == "train: step 12/12, head saved"
    logs.clear()
    run_campaign(longer, log=logs.append)  # done: nothing trained again
    assert any(m.endswith("heads/data exists") for m in logs) and not any("warm restart" in m for m in logs)
    with pytest.raises(UsageError, match="already ran 12 steps: extend it to more than that"):
        run_campaign(replace(longer, train=replace(longer.train, data=replace(longer.train.data, steps=10))))
    assert (alone.work / "heads" / "data").exists()  # nothing moved


def test_a_later_request_round_appends_prompts_and_keeps_their_ids(tiny_target, tmp_path):
    """Adding a round after prompts.jsonl exists keeps every kept prompt on its line (answers made for
    them stay valid) and appends the new ones; a change that would move a kept prompt is refused."""
    target, data = load_model(str(tiny_target), dtype="float32"), tmp_path / "data"
    first = PromptConfig(requests=12, shard_size=6, batch_size=6)
    before = run_prompt_stage(target, data, first, lambda m: None).read_text()
    more = replace(first, more=[RequestRound("thin", 8, seed=1, mix="thin")])
    logs: list[str] = []
    after = run_prompt_stage(target, data, more, logs.append).read_text()
    assert after.startswith(before) and len(after.splitlines()) >= len(before.splitlines())
    assert any(m.startswith("prompts thin shard 2/2:") for m in logs) and not any(m.startswith("prompts raw") for m in logs)
    report = json.loads((data / "prompts-report.json").read_text())
    assert report["requests"] == 20 and [r["name"] for r in report["rounds"]] == ["raw", "thin"]
    assert run_prompt_stage(target, data, more, logs.append) and logs[-1].endswith("exists")  # up to date: nothing redone
    raw = data / "prompts" / "raw-00000.jsonl"  # an earlier shard changed under the kept prompts
    rows = [json.loads(line) for line in raw.read_text().splitlines()]
    kept = [r for r in rows if r["prompt"]]
    kept[0]["prompt"] = "Completely different words that nobody wrote before ?"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UsageError, match="would change prompts already kept"):
        run_prompt_stage(target, data, replace(more, more=[*more.more, RequestRound("late", 2, seed=2)]), logs.append)
    assert (data / "prompts.jsonl").read_text() == after


def test_the_thin_mix_asks_for_writing_and_reasoning():
    cats = [r.category for r in build_requests(400, seed=1, mix="thin")]
    assert cats.count("writing") + cats.count("reasoning") >= 0.8 * len(cats)
    assert build_requests(50, seed=3) == build_requests(50, seed=3, mix="all")  # the first round is unchanged


def head_figures(agreement: float, fixed: float, default: float) -> dict:
    return {"agreement": [agreement], "tau_fixed": {"tau": fixed}, "tau_default": {"tau": default}}


def test_the_ship_rule_needs_the_head_better_and_the_default_tau_not_lower_than_2_percent():
    shipped = head_figures(0.35, 1.44, 1.318)
    assert better(head_figures(0.43, 1.56, 1.311), shipped)  # the campaign's data head (0.5% lower default tau)
    assert better(head_figures(0.5, 1.6, 1.6), shipped)
    assert not better(head_figures(0.5, 1.6, 1.28), shipped)  # default tau 2.9% lower
    assert not better(head_figures(0.5, 1.44, 1.6), shipped)  # the head alone no better
    assert not better(head_figures(0.3, 2.0, 2.0), shipped)  # lower agreement


def test_the_default_tau_measures_every_head_prompt_by_prompt_in_rotating_order(tmp_path, monkeypatch):
    """Each prompt runs every head before the next prompt starts, the first head rotating, so a
    change in the machine's load reaches every head alike."""
    from viasd_core.training import campaign_eval

    (tmp_path / "dev.jsonl").write_text("".join(json.dumps({"category": "qa", "prompt": f"p{i}"}) + "\n" for i in range(4)))
    order: list[tuple[str, str]] = []
    formats = set()

    def session(target, folder, ctx, hybrid=False, fmt=None):
        formats.add((hybrid, fmt))
        return str(folder)

    monkeypatch.setattr(campaign_eval, "head_session", session)

    def run(session, prompts, config, gen, total):
        assert gen.adaptive and len(prompts) == 1
        order.append((prompts[0].text, session))
        total.new_tokens += 3
        total.target_passes += 2

    monkeypatch.setattr(campaign_eval, "_run_sd", run)
    heads = {name: tmp_path / name for name in ("a", "b", "shipped")}
    out = campaign_eval.tau_default("t", heads, EvalConfig(prompts=tmp_path / "dev.jsonl"), INT4)
    assert formats == {(True, INT4)}  # the sessions' target at the format asked for
    assert [str(Path(h).name) for _, h in order] == ["a", "b", "shipped", "b", "shipped", "a",
                                                      "shipped", "a", "b", "a", "b", "shipped"]
    assert [p for p, _ in order] == [f"p{i}" for i in range(4) for _ in range(3)]
    assert {n: (f["new_tokens"], f["target_passes"], f["tau"]) for n, f in out.items()} == {
        n: (12, 8, 1.5) for n in heads}


# ---------------------------------------------------------------------- the target as deployed (a weight format)
def _shard_answers(data: Path) -> dict[str, list[list[int]]]:
    return {p.stem: [s.tolist() for s in store.SequenceShard.load(p).sequences]
            for p in sorted((data / "answers").glob("*.npz"))}


def _answers_of(target, prompts: list[str], config: AnswerConfig) -> dict[str, list[list[int]]]:
    """What campaign_answers asks of `target` for every shard: the reference the stage must equal."""
    out = {}
    for split, temperature in (("greedy", 0.0), ("sampled", config.temperature)):
        for k, lo in enumerate(range(0, len(prompts), config.shard_size)):
            recs = teacher_answers.build_dataset(target, prompts[lo : lo + config.shard_size], config.max_new_tokens,
                                                 batch_size=config.batch_size, temperature=temperature,
                                                 seed=config.seed * 100_003 + k, max_prompt_tokens=config.max_prompt_tokens)
            out[store.shard_name(split, k)] = [r.input_ids.tolist() for r in recs]
    return out


def test_a_campaign_for_a_weight_format_answers_with_that_target_and_refuses_another(tiny_target, tmp_path, viasd_home):
    """The default campaign is today's (float32 answers, no record written); --quant int4 on its
    prompts writes the int4 target's answers, records the format and the prompts it used, trains
    a head that names its format, and refuses a resume with another format or changed prompts."""
    (tmp_path / "dev.jsonl").write_text(json.dumps({"category": "qa", "prompt": "What is the w3 of w4 ?"}) + "\n")
    (tmp_path / "extra.jsonl").write_text("".join(json.dumps({"category": "text", "prompt": f"w{i} w{i + 1} w{2 * i} ?"}) + "\n"
                                                 for i in range(10, 20)))
    base = tiny_config(tiny_target, tmp_path / "f32", tmp_path)
    run_campaign(base, until="answers")
    prompts_file = base.data / "prompts.jsonl"
    texts = [p.text for p in load_prompts(prompts_file)]
    f32 = _answers_of(load_model(str(tiny_target), dtype="float32"), texts, base.answers)
    assert _shard_answers(base.data) == f32  # the default: the float32 target, as before the format existed
    assert not (base.data / "campaign.json").exists() and not (base.work / "campaign.json").exists()

    q = replace(base, data=tmp_path / "i4" / "data", work=tmp_path / "i4" / "work", quant="int4", prompts_from=prompts_file)
    logs: list[str] = []
    run_campaign(q, until="answers", log=logs.append)
    int4 = load_model(str(tiny_target), quant="int4")
    assert int4.model.dtype == torch.bfloat16
    assert _shard_answers(q.data) == _answers_of(int4, texts, q.answers)
    assert _shard_answers(q.data) != f32  # the format was used: the float32 answers differ
    assert not (q.data / "prompts.jsonl").exists() and not (q.data / "prompts").exists()  # referenced, not copied
    lines = prompts_file.read_bytes().splitlines(keepends=True)
    assert json.loads((q.data / "campaign.json").read_text()) == {"target_format": "int4", "prompts_from": {
        "path": "../../f32/data/prompts.jsonl", "count": len(texts), "sha256": hashlib.sha256(b"".join(lines)).hexdigest()}}
    assert json.loads((q.work / "campaign.json").read_text()) == {"target_format": "int4"}
    assert any(m.startswith(f"prompts: {len(texts)} prompts of ") for m in logs)
    assert status(q)[0].endswith("target format int4") and status(q)[1].startswith(f"answers: greedy {len(f32) // 2}/{len(f32) // 2} shards")

    before = _files(q.data)
    for other, held in ((replace(q, quant="none"), "int4"), (replace(q, quant="int8"), "int4"),
                        (replace(base, quant="int4"), "float32")):  # the float32 folders hold no record
        with pytest.raises(UsageError, match=f"holds a campaign of the {held} target, not the"):
            run_campaign(other, until="answers")
    with pytest.raises(UsageError, match="uses the prompts of"):
        run_campaign(replace(q, prompts_from=tmp_path / "extra.jsonl"), until="answers")
    assert _files(q.data) == before and not (base.data / "campaign.json").exists()  # nothing written by a refused run

    # prompts appended upstream (a later round) leave the lines used alone: accepted, nothing redone
    prompts_file.write_text(prompts_file.read_text() + json.dumps({"category": "qa", "prompt": "w1 w2 ?"}) + "\n")
    logs.clear()
    run_campaign(q, until="answers", log=logs.append)
    assert _files(q.data) == before and not any(" tokens in " in m for m in logs)
    # a used prompt changed: refused
    prompts_file.write_text(prompts_file.read_text().replace("?", "!", 1))
    with pytest.raises(UsageError, match=f"the first {len(texts)} prompts of .* changed since this campaign used them"):
        run_campaign(q, until="answers")
    prompts_file.write_bytes(b"".join(lines))

    # the features come from the int4 target; the head records the format it was trained for
    run_campaign(q, until="train")
    shard = store.SequenceShard.load(q.data / "answers" / "greedy-00000.npz")
    recs = eagle_data.teacher_pass(int4.model, [(s.tolist(), p, "") for s, p in zip(shard.sequences, shard.prompt_lens)],
                                    eagle_data.default_feature_layers(4), batch_size=q.teacher_batch_size)
    stored = store.FeatureShard(q.work / "features" / "greedy-00000").rows(0, shard.positions)
    assert torch.equal(stored[0], torch.cat([r.features for r in recs]))
    assert torch.equal(stored[1], torch.cat([r.top_ids for r in recs]))
    record = json.loads((q.work / "heads" / "data" / "config.json").read_text())["viasd_training"]
    assert record["target_format"] == "int4"


def test_an_int4_campaign_is_evaluated_on_the_int4_target(tiny_target, tmp_path, viasd_home, monkeypatch):
    """--quant int4 runs to the end: the evaluation's answers and features are the int4 target's (not
    float32's), every `sd` session's target is packed int4, the shipped head is measured on it too, the
    report and the cached figures name the format, and a figure cached at another format is measured
    again."""
    from viasd_core.runtime.weight_formats import PackedLinear
    from viasd_core.training import campaign_eval

    (tmp_path / "dev.jsonl").write_text("".join(json.dumps({"category": c, "prompt": p}) + "\n" for c, p in
                                               [("qa", "What is the w3 of w4 ?"), ("writing", "Write a haiku about bees .")]))
    (tmp_path / "extra.jsonl").write_text("".join(json.dumps({"category": "text", "prompt": f"w{i} w{i + 1} w{2 * i} ?"}) + "\n"
                                                 for i in range(10, 20)))
    q = replace(tiny_config(tiny_target, tmp_path, tmp_path), quant="int4")
    save_feature_head(eagle_init.init_head(AutoModelForCausalLM.from_pretrained(tiny_target), (1, 2, 3),
                                           torch.arange(0, 256, 4), seed=9), q.ship_to)
    sessions = []
    plain_session = campaign_eval.build_session

    def spy(opts, **k):  # at one thread: --threads auto's timing at each session is not what this test checks
        sessions.append(plain_session(replace(opts, threads="1"), **k))
        return sessions[-1]

    monkeypatch.setattr(campaign_eval, "build_session", spy)
    logs: list[str] = []
    report = run_campaign(q, log=logs.append)
    assert report["target_format"] == "int4" and json.loads((q.data / "eval-report.json").read_text()) == report
    assert report["decision"] in ("ship data", "ship on_policy", "keep the shipped head")
    figures = [report["candidates"]["data"], report["candidates"]["on_policy"], report["shipped"]]
    assert all(f["target_format"] == "int4" and f["tau_fixed"]["target_passes"] > 0 for f in figures)
    assert status(q)[-1] == "eval: done"

    # the records: the int4 target's greedy answers to the evaluation prompts, teacher-forced by it
    assert not (q.work / "eval" / "features.pt").exists()  # the float32 target's name is left to it
    records = eagle_data.load_records(q.work / "eval" / "features-int4.pt")
    prompts = load_prompts(tmp_path / "dev.jsonl")
    texts, cats = [p.text for p in prompts], [p.category for p in prompts]
    targets = {"int4": load_model(str(tiny_target), quant="int4"), "none": load_model(str(tiny_target), dtype="float32")}
    answers = teacher_answers.build_dataset(targets["int4"], texts, q.evaluation.answer_tokens, batch_size=32, categories=cats)
    assert [r.tokens.tolist() for r in records] == [r.input_ids.tolist() for r in answers]
    seqs = [(r.tokens.tolist(), r.prompt_len, r.category) for r in records]
    feats = {fmt: eagle_data.teacher_pass(t.model, seqs, eagle_data.default_feature_layers(4)) for fmt, t in targets.items()}
    assert all(torch.equal(r.features, f.features) for r, f in zip(records, feats["int4"]))
    assert not all(torch.equal(r.features, f.features) for r, f in zip(records, feats["none"]))  # not float32's

    # every sd session (the head alone, each head; the default, every head) drafts for the int4 target
    assert len(sessions) == 3 + 3
    for session in sessions:
        assert session.target.quant == "int4" and session.options.dtype is None
        assert "int4" in {m.kind for m in session.target.model.modules() if isinstance(m, PackedLinear)}

    # the cached figures hold for their format only: one measured at another format is measured again
    monkeypatch.setattr(campaign_eval, "tau_fixed", lambda ref, head, config, fmt: {"tau": 1.0, "format": fmt.name})

    def measure(name: str, fmt: str) -> dict:
        return campaign_eval.measure(name, q.work / "heads" / name, targets[fmt], str(tiny_target), records, q.evaluation,
                                     q.work, logs.append)

    cached = {name: json.loads((q.work / "eval" / f"{name}.json").read_text()) for name in ("data", "on_policy")}
    assert cached["data"]["target_format"] == "int4" and cached["data"]["tau_fixed"] == report["candidates"]["data"]["tau_fixed"]
    logs.clear()
    assert measure("on_policy", "int4") == cached["on_policy"] and logs == []  # the same format: reused
    (q.work / "eval" / "data.json").write_text(json.dumps({**cached["data"], "target_format": "none"}))
    again = measure("data", "int4")  # cached at float32: measured again at int4
    assert logs[-1].startswith("eval data:") and again["tau_fixed"] == {"tau": 1.0, "format": "int4"}
    assert again["target_format"] == "int4" and again["agreement"] == cached["data"]["agreement"]
    assert json.loads((q.work / "eval" / "data.json").read_text()) == again
    assert measure("on_policy", "none")["tau_fixed"] == {"tau": 1.0, "format": "none"}  # and int4's not read as float32's


def test_packed_answers_hold_the_widened_weights_once_and_the_numbers_stay(tiny_target, monkeypatch):
    """build_dataset on an int4 target holds the widened weight of every layer that takes the dense
    product (a batch of 17 rows or more; not the layers whose short product runs such batches in
    chunks of 16 rows, the AVX2 class's int8-activation products) for the whole call; the answers
    equal those widened per pass."""
    from viasd_core.runtime.weight_formats import PackedLinear

    target = load_model(str(tiny_target), quant="int4")
    dense = [m for m in target.model.modules() if isinstance(m, PackedLinear)
             and not (m._short is not None and m._short.chunks)]
    texts = [f"w{i} w{i + 3} w{2 * i} ?" for i in range(10, 30)]
    plain_generate = teacher_answers.generate_batch
    holding: list[bool] = []

    def spy(model, *a, **k):
        holding.append(bool(dense) and all(m.holding for m in dense))
        return plain_generate(model, *a, **k)

    monkeypatch.setattr(teacher_answers, "generate_batch", spy)
    for temperature in (0.0, 0.8):
        held = teacher_answers.build_dataset(target, texts, 12, batch_size=20, temperature=temperature, seed=3)
        assert holding == [bool(dense)]  # nothing to hold where every layer runs its batches in chunks
        with monkeypatch.context() as m:
            m.setattr(teacher_answers, "_widened_once", lambda model: contextlib.nullcontext())
            plain = teacher_answers.build_dataset(target, texts, 12, batch_size=20, temperature=temperature, seed=3)
        assert holding == [bool(dense), False]
        assert [r.input_ids.tolist() for r in held] == [r.input_ids.tolist() for r in plain]
        assert [r.labels.tolist() for r in held] == [r.labels.tolist() for r in plain]
        holding.clear()
    assert not any(m.holding for m in target.model.modules() if isinstance(m, PackedLinear))  # dropped after the call
