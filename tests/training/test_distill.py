"""Draft distillation and the shipped-draft format, on a tiny random Llama target (fast), plus one slow
test of the draft shipped in the package."""

from __future__ import annotations

import json

import pytest
import torch

from viasd_core.training import draft_eval, draft_init, draft_train, teacher_answers
from viasd_core.loading.draft_model import embedded_draft_dir, load_draft, read_draft_config, save_draft
from viasd_core.errors import ViasdError

VOCAB = 96


class FakeTokenizer:
    """Just enough tokenizer for the vocabulary check."""

    def __init__(self, vocab_size: int = VOCAB, salt: str = "t"):
        self._vocab = {f"{salt}{i}": i for i in range(vocab_size)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=2,
        pad_token_id=2, bos_token_id=1,
    )
    return LlamaForCausalLM(cfg).eval()


def _records(n: int = 6, length: int = 20) -> list[teacher_answers.Record]:
    """Sequences whose label is a fixed function of the current token (learnable by a tiny model)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 40, (length,), generator=gen)
        prompt_len = 5
        labels = (ids[prompt_len - 1 : -1] * 7 + 3) % 40 + 3
        out.append(teacher_answers.Record(input_ids=ids, prompt_len=prompt_len, labels=labels))
    return out


def test_choose_vocab_and_coverage():
    recs = [teacher_answers.Record(torch.tensor([5, 6, 7, 7, 7, 9]), 2, torch.tensor([7, 7, 7, 9]))]
    vocab_map = teacher_answers.choose_vocab(recs, 2, always=[2])
    assert vocab_map.tolist() == [2, 7]  # eos kept, then the most frequent label; sorted by id
    assert teacher_answers.vocab_coverage(recs, vocab_map) == pytest.approx(0.75)


def test_default_prompts_ship_with_the_package():
    from viasd_core.loading.prompts import load_prompts

    prompts = load_prompts(teacher_answers.DEFAULT_PROMPTS)
    assert len(prompts) >= 100 and all(p.text.strip() for p in prompts)


def test_train_save_load_roundtrip(target, tmp_path):
    recs = _records()
    vocab_map = teacher_answers.choose_vocab(recs, 32, always=[2])
    draft = draft_init.init_draft(target, 2, vocab_map)
    assert draft.get_input_embeddings() is target.get_input_embeddings()
    # the head starts as the target's output rows for vocab_map
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[vocab_map])
    emb_before = target.get_input_embeddings().weight.clone()
    losses = draft_train.train_draft(draft, recs, vocab_map, steps=30, batch_size=3, lr=3e-3, warmup=3)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert torch.equal(target.get_input_embeddings().weight, emb_before)  # the shared embedding stays frozen
    assert target.get_input_embeddings().weight.requires_grad  # and its flag is restored

    tok = FakeTokenizer()
    folder = save_draft(tmp_path / "draft", draft, vocab_map, tok, target="tiny", training={"steps": 30}, dtype=torch.float32)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    cfg = read_draft_config(folder)
    assert cfg["draft_vocab_size"] == vocab_map.numel() and cfg["llama_config"]["vocab_size"] == VOCAB
    assert cfg["llama_config"]["num_hidden_layers"] == 2

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert not any("embed_tokens" in k for k in keys)  # the embedding is not stored
    assert "vocab_map" in keys and "lm_head.weight" in keys

    loaded = load_draft(folder, target, tokenizer=tok)
    assert loaded.model.embed_tokens is target.get_input_embeddings()
    assert loaded.model.embed_tokens.weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert isinstance(loaded.lm_head, torch.nn.Linear) and loaded.lm_head.bias is None
    assert tuple(loaded.lm_head.weight.shape) == (vocab_map.numel(), 32)
    assert loaded.viasd_vocab_map.dtype == torch.int64 and torch.equal(loaded.viasd_vocab_map, vocab_map)

    ids = recs[0].input_ids[None]
    with torch.no_grad():
        ref = draft(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert got.shape == (1, ids.shape[1], vocab_map.numel())
    assert torch.equal(ref, got)

    # an ordinary HF decode with a KV cache gives the same last-step logits
    with torch.no_grad():
        out = loaded(input_ids=ids[:, :-1], use_cache=True)
        step = loaded(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step[0, -1], got[0, -1], rtol=1e-4, atol=1e-5)

    # The trained draft has learnt the rule: its argmax, mapped to target ids, often equals the
    # label that the rule (ids * 7 + 3) % 40 + 3 gives, computed here from the ids.
    rec = recs[1]
    res = draft_eval.evaluate_agreement(loaded, records=[rec])
    rule = (rec.input_ids[rec.prompt_len - 1 : -1] * 7 + 3) % 40 + 3
    with torch.no_grad():
        draft_idx = loaded(input_ids=rec.input_ids[None]).logits[0, rec.prompt_len - 1 : -1].argmax(-1)
    hits = sum(int(vocab_map[i]) == int(r) for i, r in zip(draft_idx.tolist(), rule.tolist()))
    assert res["tokens"] == rule.numel() and res["agreement"] == pytest.approx(hits / rule.numel())
    assert res["agreement"] > 0.5


def test_tokenizer_mismatch_refused(target, tmp_path):
    recs = _records(2)
    vocab_map = teacher_answers.choose_vocab(recs, 16)
    draft = draft_init.init_draft(target, 1, vocab_map)
    folder = save_draft(tmp_path / "d", draft, vocab_map, FakeTokenizer(), target="tiny")
    with pytest.raises(ViasdError, match="different tokenizer"):
        load_draft(folder, target, tokenizer=FakeTokenizer(salt="other"))
    # a folder that is not a draft
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"format": "nope"}))
    with pytest.raises(ViasdError, match="not a viasd draft"):
        load_draft(tmp_path / "x", target)


def test_save_replaces_atomically(target, tmp_path):
    recs = _records(2)
    vocab_map = teacher_answers.choose_vocab(recs, 16)
    draft = draft_init.init_draft(target, 1, vocab_map)
    folder = tmp_path / "d"
    save_draft(folder, draft, vocab_map, FakeTokenizer(), target="a")
    save_draft(folder, draft, vocab_map, FakeTokenizer(), target="b")
    assert read_draft_config(folder)["target"] == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary folders left


def test_generate_batch_left_padding_matches_single(target):
    prompts = [[1, 5, 6, 7, 8, 9, 10], [1, 11, 12]]
    batched = teacher_answers.generate_batch(target, prompts, 6, eos_ids={2}, pad_id=2)
    for p, (toks, labels) in zip(prompts, batched):
        single = teacher_answers.generate_batch(target, [p], 6, eos_ids={2}, pad_id=2)[0]
        assert toks == single[0] and labels == toks


class FakeDraft(torch.nn.Module):
    """A 'draft' whose argmax at each position is given: draft indices, not target ids."""

    def __init__(self, argmax: list[int], width: int):
        super().__init__()
        self.embed = torch.nn.Embedding(1, 1)
        self.argmax, self.width = argmax, width

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        logits = torch.zeros(1, input_ids.shape[1], self.width)
        start = input_ids.shape[1] - len(self.argmax)  # the last positions predict the labels
        for j, idx in enumerate(self.argmax):
            logits[0, start + j, idx] = 1.0
        return SimpleNamespace(logits=logits)


def test_evaluate_agreement_maps_draft_indices_through_vocab_map():
    vocab_map = torch.tensor([2, 7, 9, 11])  # draft index -> target id
    # prompt of 3, labels for 4 new tokens; 5 is outside the draft vocabulary
    rec = teacher_answers.Record(torch.tensor([20, 21, 22, 9, 7, 11, 5]), 3, torch.tensor([9, 7, 11, 5]), category="qa")
    # draft indices 2, 1, 0, 3 -> target ids 9, 7, 2, 11: the first two equal the labels
    res = draft_eval.evaluate_agreement(FakeDraft([2, 1, 0, 3], 4), records=[rec], vocab_map=vocab_map)
    assert res == {"agreement": 0.5, "tokens": 4, "prompts": 1, "by_category": {"qa": 0.5}}
    # without the mapping (index == id) only position 1 would match: the map is really applied
    res = draft_eval.evaluate_agreement(FakeDraft([2, 1, 0, 3], 12), records=[rec], vocab_map=torch.arange(12))
    assert res["agreement"] == 0.0


def test_measure_cost_reports_median_ms_and_ratio(target, monkeypatch):
    """On a fake clock each forward of the draft costs 2 ms and of the target 8 ms, with a 100 ms
    stall on every fourth call: the medians are 2 and 8, the ratio 0.25."""
    from types import SimpleNamespace

    vocab_map = torch.arange(16)
    draft = draft_init.init_draft(target, 1, vocab_map)
    clock = {"now": 0.0}

    def costing(ms):
        calls = {"n": 0}

        def hook(module, args, kwargs, output):
            calls["n"] += 1
            clock["now"] += (100 if calls["n"] % 4 == 0 else ms) / 1000
        return hook

    handles = [target.register_forward_hook(costing(8), with_kwargs=True),
               draft.register_forward_hook(costing(2), with_kwargs=True)]
    monkeypatch.setattr(draft_eval, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    try:
        res = draft_eval.measure_cost(draft, target, prompt_len=8, steps=5, warmup=1, repeats=2)
    finally:
        for h in handles:
            h.remove()
    assert res["steps"] == 10
    assert res["draft_ms"] == pytest.approx(2.0) and res["target_ms"] == pytest.approx(8.0)
    assert res["ratio"] == pytest.approx(0.25)


@pytest.mark.slow
def test_shipped_draft():
    folder = embedded_draft_dir()
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size <= 20 * 1000 * 1000
    cfg = read_draft_config(folder)
    assert cfg["target"] == "smollm2-135m"
    llama = cfg["llama_config"]
    assert llama["vocab_size"] == 49152 and llama["hidden_size"] == 576 and llama["num_hidden_layers"] <= 4
    assert 4096 <= cfg["draft_vocab_size"] <= 16384
    assert len(cfg["tokenizer_vocab_sha256"]) == 64

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("vocab_map").dtype == torch.int64
        assert tuple(f.get_slice("lm_head.weight").get_shape()) == (cfg["draft_vocab_size"], 576)
        assert not any("embed_tokens" in k for k in f.keys())


def test_early_stopping_restores_best(target):
    recs = _records(4)
    vocab_map = teacher_answers.choose_vocab(recs, 32)
    draft = draft_init.init_draft(target, 1, vocab_map)
    snapshots = []

    def eval_fn(d):  # the first evaluation scores best
        snapshots.append(d.lm_head.weight.detach().clone())
        return -len(snapshots)

    draft_train.train_draft(draft, recs, vocab_map, steps=6, batch_size=2, lr=1e-2, warmup=1, eval_fn=eval_fn, eval_every=2)
    assert len(snapshots) == 3 and not torch.equal(snapshots[0], snapshots[-1])
    assert torch.equal(draft.lm_head.weight, snapshots[0])
    assert draft.viasd_train_log["best_step"] == 2
