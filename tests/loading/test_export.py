"""`viasd export` and the speculators layout: a tiny EAGLE-3 head saved in each layout loads back
and drafts the same tokens (same logits, bit for bit); the exported folders hold what vLLM's and
SGLang's loaders read (names, shapes, dtypes, config keys, d2t/t2d), checked against those loaders'
rules as written in their source (cited at each check); bad input is one line, nothing written.

No engine runs here: the loaders' name mapping is re-stated from their source, not imported."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from viasd_core.speculation.eagle import FeatureHead
from viasd_core.speculation.eagle_files import load_feature_head, save_feature_head
from viasd_core.errors import ViasdError
from viasd_core.loading.head_export import draft_length, export_head
from viasd_core.training.eagle_init import head_config

H, I, HEADS, KV, D, VOCAB, DRAFT_VOCAB, LAYERS = 32, 64, 4, 2, 8, 96, 40, (1, 3, 4)
TARGET = LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
                     num_hidden_layers=6, vocab_size=VOCAB, rope_theta=10000.0)


def _embed() -> torch.nn.Embedding:
    torch.manual_seed(7)
    return torch.nn.Embedding(VOCAB, H)


def _make_head(folder, layers=LAYERS, **extra):
    """A random head (every weight drawn, norms near 1) over a scattered draft vocabulary, saved in
    the EAGLE-3 layout by viasd's own writer."""
    torch.manual_seed(0)
    cfg = head_config(TARGET, layers, DRAFT_VOCAB)
    cfg.update(extra)
    head = FeatureHead(cfg, tuple(layers), embed=_embed())
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
        ids = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
        head.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()
        head.t2d[ids] = True
    return save_feature_head(head, folder)


def _drafts(folder, steps: int = 4):
    """Catch up over 6 positions of random features (each row drafts for its context), then draft
    `steps` - 1 more tokens greedily from the head's own features: (every row's logits, the drafted
    target ids)."""
    head = load_feature_head(folder, TARGET, embed=_embed(), dtype=torch.float32, max_len=32)
    g = torch.Generator().manual_seed(3)
    tokens, feats = torch.randint(0, VOCAB, (6,), generator=g), torch.randn(6, 3 * H, generator=g)
    logits, hidden = head.forward(tokens, feats, 0)  # every catch-up row: six contexts' first drafts
    all_logits, drafted = [logits], [head.to_target_ids(logits.argmax(-1))]
    for i in range(steps - 1):
        logits, hidden = head.forward(drafted[-1][-1:], hidden[-1:], 6 + i, n_logits=1)
        all_logits.append(logits)
        drafted.append(head.to_target_ids(logits.argmax(-1)))
    return torch.cat(all_logits), torch.cat(drafted)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return _make_head(tmp_path_factory.mktemp("heads") / "head")


def _same_drafts(a, b):
    (la, ta), (lb, tb) = _drafts(a), _drafts(b)
    assert torch.equal(ta, tb), (ta, tb)
    assert torch.equal(la, lb)
    assert len(set(ta.tolist())) > 1  # the drafts are not one repeated token (a vacuous comparison)


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("engine,layout", [("vllm", "eagle3"), ("sglang", "eagle3"), ("vllm", "speculators")])
def test_an_exported_head_loads_back_and_drafts_the_same_tokens(head_dir, tmp_path, engine, layout):
    out = export_head(head_dir, engine, tmp_path / "out", layout=layout).folder
    raw = json.loads((out / "config.json").read_text())
    assert ("speculators_model_type" in raw) == (layout == "speculators")
    _same_drafts(head_dir, out)


def test_a_speculators_head_with_norm_before_residual_computes_its_own_formula(head_dir, tmp_path):
    """norm_before_residual (speculators' Eagle3 first layer: residual = hidden_norm(fused)) is
    honoured: one position (attention over itself is its own value) against a hand-written layer."""
    out = export_head(head_dir, "vllm", tmp_path / "spec", layout="speculators").folder
    cfg = json.loads((out / "config.json").read_text())
    cfg["norm_before_residual"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(out / "model.safetensors"))
    embed = _embed()
    g = torch.Generator().manual_seed(5)
    token, feat = torch.randint(0, VOCAB, (1,), generator=g), torch.randn(1, 3 * H, generator=g)

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + TARGET.rms_norm_eps)

    def reference(before: bool):
        fused = feat @ w["fc.weight"].T
        normed = rms(fused, w["layers.0.hidden_norm.weight"])
        x = torch.cat((rms(embed.weight[token], w["layers.0.input_layernorm.weight"]), normed), -1)
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(KV, D).repeat_interleave(HEADS // KV, 0).reshape(1, -1)
        h = (normed if before else fused) + v @ w["layers.0.self_attn.o_proj.weight"].T
        m = rms(h, w["layers.0.post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T)
        h = h + mlp @ w["layers.0.mlp.down_proj.weight"].T
        return rms(h, w["norm.weight"]) @ w["lm_head.weight"].T

    with torch.no_grad():
        got = load_feature_head(out, TARGET, embed=embed, dtype=torch.float32).forward(token, feat, 0)[0]
        torch.testing.assert_close(got, reference(True), rtol=1e-4, atol=1e-4)
        assert not torch.allclose(got, reference(False), rtol=1e-3, atol=1e-3)  # the flag changes the head


def test_a_speculators_head_with_a_feature_norm_or_another_layer_is_refused(head_dir, tmp_path):
    out = export_head(head_dir, "vllm", tmp_path / "spec", layout="speculators").folder
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True}))
    with pytest.raises(ViasdError, match="norm_before_fc"):
        load_feature_head(out, TARGET, embed=_embed())
    (out / "config.json").write_text(json.dumps({**cfg, "transformer_layer_config": {**cfg["transformer_layer_config"], "model_type": "qwen3"}}))
    with pytest.raises(ViasdError, match="qwen3"):
        load_feature_head(out, TARGET, embed=_embed())


# ---------------------------------------------------------------------- what the engines' loaders read
def _head_shapes(draft_vocab=DRAFT_VOCAB):
    return {"qkv": [(HEADS + 2 * KV) * D, 2 * H], "o": [H, HEADS * D], "gate_up": [2 * I, H], "down": [H, I],
            "norm": [H], "fc": [H, 3 * H], "lm_head": [draft_vocab, H]}


STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def _stack(loaded: dict[str, dict]) -> dict[str, torch.Size]:
    """Shards of one fused parameter, concatenated in shard order (QKVParallelLinear, MergedColumnParallelLinear)."""
    order = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, None: 0}
    return {name: torch.cat([t for _, t in sorted(parts.items(), key=lambda kv: order[kv[0]])]).shape
            for name, parts in loaded.items()}


def test_the_vllm_export_holds_what_vllms_llama_eagle3_loads(head_dir, tmp_path):
    out = export_head(head_dir, "vllm", tmp_path / "v").folder
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    # vllm/transformers_utils/configs/eagle.py EAGLEConfig.__init__ (method eagle3): an architecture
    # ending in "Eagle3" is kept, and the registry maps LlamaForCausalLMEagle3 to llama_eagle3.py.
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    # vllm/model_executor/models/llama_eagle3.py Eagle3LlamaForCausalLM.__init__: lm_head and the
    # d2t buffer are draft_vocab_size rows; LlamaModel.__init__: fc reads 3 * target_hidden_size.
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["vocab_size"] == VOCAB and cfg["target_hidden_size"] == H
    assert cfg["num_hidden_layers"] == 1 and not cfg.get("norm_before_residual")  # _norm_after_residual, as trained
    assert cfg["eagle_config"].get("use_aux_hidden_state", True) is True  # LlamaModel.__init__ builds fc only then
    # vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config: the top-level ids first,
    # as they are; llama.py LlamaModel.forward appends hidden_states + residual before layer idx runs
    # (the layer's input): viasd's feature layers.
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    # Eagle3LlamaForCausalLM.load_weights: t2d skipped, d2t -> draft_id_to_target_id, everything but
    # lm_head under "model."; LlamaModel.load_weights: "midlayer." -> "layers.0.", q/k/v and
    # gate/up stacked (stacked_params_mapping); embed_tokens skipped when the file has none.
    loaded: dict[str, dict] = {}
    for name, w in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        shard = None
        for param, weight, shard_id in STACKED:
            if weight in name:
                name, shard = name.replace(weight, param), shard_id
                break
        loaded.setdefault(name, {})[shard] = w
    s = _head_shapes()
    expected = {"model.layers.0.self_attn.qkv_proj.weight": s["qkv"], "model.layers.0.self_attn.o_proj.weight": s["o"],
                "model.layers.0.mlp.gate_up_proj.weight": s["gate_up"], "model.layers.0.mlp.down_proj.weight": s["down"],
                "model.layers.0.input_layernorm.weight": s["norm"], "model.layers.0.hidden_norm.weight": s["norm"],
                "model.layers.0.post_attention_layernorm.weight": s["norm"], "model.fc.weight": s["fc"],
                "model.norm.weight": s["norm"], "lm_head.weight": s["lm_head"], "draft_id_to_target_id": [DRAFT_VOCAB]}
    assert {k: list(v) for k, v in _stack(loaded).items()} == expected
    # draft_id_to_target_id is an int64 parameter (torch.long); compute_logits scatters draft
    # column j to target id j + d2t[j]: in range and one column per id.
    d2t = tensors["d2t"]
    assert d2t.dtype == torch.int64
    ids = torch.arange(DRAFT_VOCAB) + d2t
    assert 0 <= int(ids.min()) and int(ids.max()) < VOCAB and ids.unique().numel() == DRAFT_VOCAB
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (VOCAB,)
    assert torch.equal(tensors["t2d"].nonzero().flatten(), ids.sort().values)


def test_the_sglang_export_holds_what_sglangs_llama_eagle3_loads(head_dir, tmp_path):
    out = export_head(head_dir, "sglang", tmp_path / "s").folder
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    # python/sglang/srt/models/llama_eagle3.py: EntryClass = [LlamaForCausalLMEagle3].
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    # LlamaForCausalLMEagle3.__init__: tie_word_embeddings makes lm_head the embedding; a missing
    # draft_vocab_size loads the target's lm_head instead of ours.
    assert cfg["tie_word_embeddings"] is False and cfg["draft_vocab_size"] == DRAFT_VOCAB
    # LlamaModel.__init__: fc reads 3 * target_hidden_size; LlamaDecoderLayer.forward takes its
    # residual before hidden_norm (no norm_before_residual there).
    assert cfg["target_hidden_size"] == H and not cfg.get("norm_before_residual")
    # model_runner: the ids under eagle_config only; llama.py set_eagle3_layers_to_capture adds 1
    # and LlamaModel.forward captures hidden_states + residual before layer i: viasd's layers.
    assert [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == list(LAYERS)
    # LlamaForCausalLMEagle3.load_weights: d2t -> hot_token_id = d2t + arange; t2d skipped; q/k/v,
    # gate/up stacked; "model." prefixed when the bare name is no parameter; names matching no
    # parameter are skipped without a word, so every tensor must land on one.
    params = {"lm_head.weight", "model.fc.weight", "model.norm.weight", "model.embed_tokens.weight"} | {
        f"model.midlayer.{n}.weight" for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                                               "input_layernorm", "hidden_norm", "post_attention_layernorm")}
    loaded: dict[str, dict] = {}
    hot = None
    for name, w in tensors.items():
        if "d2t" in name:
            hot = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        shard = None
        for param, weight, shard_id in STACKED:
            if weight in name:
                name, shard = name.replace(weight, param), shard_id
                break
        name = name if name in params else f"model.{name}"
        assert name in params, f"SGLang would drop {name}"
        loaded.setdefault(name, {})[shard] = w
    s = _head_shapes()
    shapes = {k: list(v) for k, v in _stack(loaded).items()}
    assert shapes == {"model.midlayer.self_attn.qkv_proj.weight": s["qkv"], "model.midlayer.self_attn.o_proj.weight": s["o"],
                      "model.midlayer.mlp.gate_up_proj.weight": s["gate_up"], "model.midlayer.mlp.down_proj.weight": s["down"],
                      "model.midlayer.input_layernorm.weight": s["norm"], "model.midlayer.hidden_norm.weight": s["norm"],
                      "model.midlayer.post_attention_layernorm.weight": s["norm"], "model.fc.weight": s["fc"],
                      "model.norm.weight": s["norm"], "lm_head.weight": s["lm_head"]}  # embed_tokens: the target's (set_embed)
    assert hot is not None and hot.dtype == torch.int64 and hot.shape == (DRAFT_VOCAB,)
    assert 0 <= int(hot.min()) and int(hot.max()) < VOCAB and hot.unique().numel() == DRAFT_VOCAB


def test_the_speculators_export_holds_what_vllms_speculators_config_reads(head_dir, tmp_path):
    out = export_head(head_dir, "vllm", tmp_path / "p", layout="speculators", target="org/target", tokens=5).folder
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    # vllm/transformers_utils/configs/speculators/base.py validate_speculators_config: these keys must exist.
    spec = cfg["speculators_config"]
    assert cfg["speculators_model_type"] == "eagle3" and isinstance(cfg["transformer_layer_config"], dict)
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5 and spec["verifier"]["name_or_path"] == "org/target"
    # algos.py update_eagle3: norm_before_residual read with a default of True, so it is written out.
    assert cfg["norm_before_residual"] is False
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == H
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    layer = cfg["transformer_layer_config"]
    assert layer["vocab_size"] == VOCAB and layer["hidden_size"] == H and layer["num_hidden_layers"] == 1
    # llama_eagle3.py loads layers.0.* as they are (LlamaModel params); no midlayer names remain.
    assert not any(k.startswith("midlayer.") for k in tensors)
    assert {k for k in tensors if k.startswith("layers.0.")} == {
        f"layers.0.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                         "hidden_norm", "post_attention_layernorm")}
    assert set(tensors) - {k for k in tensors if k.startswith("layers.0.")} == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


# ---------------------------------------------------------------------- draft length, refusals, the CLI
def test_the_draft_length_follows_the_measured_agreement():
    raw = {"viasd_training": {"eval": {"agreement_by_position": [0.8, 0.7, 0.6, 0.5, 0.4]}}}
    # reach 0.8, 0.56, 0.336, 0.168: three positions are reached at least 30% of the time
    assert draft_length(raw)[0] == 3
    assert draft_length({"viasd_training": {"held_out_agreement": [0.95] * 8}})[0] == 8  # never past what was measured
    assert draft_length({})[0] == 3


def test_sglang_refuses_what_it_cannot_run(tmp_path):
    layer0 = _make_head(tmp_path / "l0", layers=(0, 2, 4))
    with pytest.raises(ViasdError, match="layer-0"):
        export_head(layer0, "sglang", tmp_path / "o1")
    nbr = _make_head(tmp_path / "nbr", norm_before_residual=True)
    with pytest.raises(ViasdError, match="norm_before_residual"):
        export_head(nbr, "sglang", tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert export_head(layer0, "vllm", tmp_path / "o3").folder.is_dir()  # vLLM captures layer 0's input


def test_the_cli_prints_the_serve_command_and_refuses_bad_input_in_one_line(head_dir, tmp_path):
    from typer.testing import CliRunner

    from viasd_cli.app import get_app

    runner = CliRunner()
    out = tmp_path / "x"
    r = runner.invoke(get_app(), ["export", str(head_dir), "--to", "sglang", str(out), "--target", "org/m", "--tokens", "4"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == (f"python -m sglang.launch_server --model-path org/m --speculative-algorithm EAGLE3 "
                                f"--speculative-draft-model-path {out.resolve()} --speculative-num-steps 4 "
                                "--speculative-eagle-topk 1 --speculative-num-draft-tokens 5")
    r = runner.invoke(get_app(), ["export", str(head_dir), "--to", "vllm", str(out)])
    assert r.exit_code == 0 and "vllm serve TARGET --speculative-config" in r.stdout
    assert json.loads(r.stdout.split("--speculative-config ")[1].strip().strip("'")) == {
        "method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 3}
    cases = [["--to", "tpu"], ["--to", "sglang", "--layout", "speculators"], ["--tokens", "0"]]
    for extra in cases:
        r = runner.invoke(get_app(), ["export", str(head_dir), str(tmp_path / "bad"), *extra])
        assert r.exit_code != 0 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "bad").exists()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((head_dir / "config.json").read_text())
    (damaged / "model.safetensors").write_bytes(b"\x00" * 10)
    r = runner.invoke(get_app(), ["export", str(damaged), "--to", "vllm", str(tmp_path / "bad")])
    assert r.exit_code != 0 and "damaged" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "bad").exists()


def test_a_local_target_is_checked_against_the_head(head_dir, tmp_path):
    TARGET.save_pretrained(tmp_path / "target")
    result = export_head(head_dir, "vllm", tmp_path / "ok", target=str(tmp_path / "target"))
    assert result.command.startswith(f"vllm serve {tmp_path / 'target'} ") and not result.notes
    other = LlamaConfig(**{**TARGET.to_dict(), "vocab_size": VOCAB + 8})
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ViasdError, match="vocab size"):
        export_head(head_dir, "vllm", tmp_path / "no", target=str(tmp_path / "other"))
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("key, nested", [("eagle_aux_hidden_state_layer_ids", True), ("aux_hidden_states_layer_ids", False)],
                         ids=["sglang-eagle_config", "angelslim-trainer"])
def test_layer_ids_given_as_layer_outputs_export_at_the_layers_viasd_reads(tmp_path, key, nested):
    """SGLang's eagle_config key and AngelSlim's trainer key name layer outputs (one lower than the
    inputs viasd and vLLM's top-level key name): the export writes the inputs at the top level and
    the outputs under eagle_config, and drops the trainer's own key."""
    folder = _make_head(tmp_path / "h")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    outputs = [i - 1 for i in LAYERS]
    if nested:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": outputs}
    else:
        cfg[key] = outputs
    (folder / "config.json").write_text(json.dumps(cfg))
    out = json.loads((export_head(folder, "vllm", tmp_path / "v").folder / "config.json").read_text())
    assert out["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == outputs
    assert "aux_hidden_states_layer_ids" not in out
