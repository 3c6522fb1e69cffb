"""Draft distillation and the shipped-draft format, on a tiny random Llama target (fast), plus one slow
test of the draft shipped in the package."""

from __future__ import annotations

import json

import pytest
import torch

from viasd_core import distill
from viasd_core.draft_model import embedded_draft_dir, load_draft, read_draft_config, save_draft
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


def _records(n: int = 6, length: int = 20) -> list[distill.Record]:
    """Sequences whose label is a fixed function of the current token (learnable by a tiny model)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 40, (length,), generator=gen)
        prompt_len = 5
        labels = (ids[prompt_len - 1 : -1] * 7 + 3) % 40 + 3
        out.append(distill.Record(input_ids=ids, prompt_len=prompt_len, labels=labels))
    return out


def test_choose_vocab_and_coverage():
    recs = [distill.Record(torch.tensor([5, 6, 7, 7, 7, 9]), 2, torch.tensor([7, 7, 7, 9]))]
    vocab_map = distill.choose_vocab(recs, 2, always=[2])
    assert vocab_map.tolist() == [2, 7]  # eos kept, then the most frequent label; sorted by id
    assert distill.vocab_coverage(recs, vocab_map) == pytest.approx(0.75)


def test_train_save_load_roundtrip(target, tmp_path):
    recs = _records()
    vocab_map = distill.choose_vocab(recs, 32, always=[2])
    draft = distill.init_draft(target, 2, vocab_map)
    assert draft.get_input_embeddings() is target.get_input_embeddings()
    # the head starts as the target's output rows for vocab_map
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[vocab_map])
    emb_before = target.get_input_embeddings().weight.clone()
    losses = distill.train_draft(draft, recs, vocab_map, steps=30, batch_size=3, lr=3e-3, warmup=3)
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

    # vocab_map maps the draft's argmax to target ids, and the trained draft has learnt the rule
    rec = recs[1]
    res = distill.evaluate_agreement(loaded, records=[rec])
    pred = vocab_map[got.new_tensor(0).long()]  # index 0 maps to the smallest kept id
    assert int(pred) == int(vocab_map.min())
    assert res["tokens"] == rec.labels.numel() and res["agreement"] > 0.5


def test_tokenizer_mismatch_refused(target, tmp_path):
    recs = _records(2)
    vocab_map = distill.choose_vocab(recs, 16)
    draft = distill.init_draft(target, 1, vocab_map)
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
    vocab_map = distill.choose_vocab(recs, 16)
    draft = distill.init_draft(target, 1, vocab_map)
    folder = tmp_path / "d"
    save_draft(folder, draft, vocab_map, FakeTokenizer(), target="a")
    save_draft(folder, draft, vocab_map, FakeTokenizer(), target="b")
    assert read_draft_config(folder)["target"] == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary folders left


def test_generate_batch_left_padding_matches_single(target):
    prompts = [[1, 5, 6, 7, 8, 9, 10], [1, 11, 12]]
    batched = distill.generate_batch(target, prompts, 6, eos_ids={2}, pad_id=2)
    for p, (toks, labels) in zip(prompts, batched):
        single = distill.generate_batch(target, [p], 6, eos_ids={2}, pad_id=2)[0]
        assert toks == single[0] and labels == toks


def test_measure_cost_reports_ratio(target):
    vocab_map = torch.arange(16)
    draft = distill.init_draft(target, 1, vocab_map)
    res = distill.measure_cost(draft, target, prompt_len=8, steps=5, warmup=1, repeats=1)
    assert res["steps"] == 5 and res["draft_ms"] > 0 and res["ratio"] == pytest.approx(res["draft_ms"] / res["target_ms"])


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
    vocab_map = distill.choose_vocab(recs, 32)
    draft = distill.init_draft(target, 1, vocab_map)
    snapshots = []

    def eval_fn(d):  # the first evaluation scores best
        snapshots.append(d.lm_head.weight.detach().clone())
        return -len(snapshots)

    distill.train_draft(draft, recs, vocab_map, steps=6, batch_size=2, lr=1e-2, warmup=1, eval_fn=eval_fn, eval_every=2)
    assert len(snapshots) == 3 and not torch.equal(snapshots[0], snapshots[-1])
    assert torch.equal(draft.lm_head.weight, snapshots[0])
    assert draft.viasd_train_log["best_step"] == 2
