"""EAGLE-3 head: a checkpoint written by hand in the published layout loads, computes the one layer
the sources describe (checked against a float64 reference written here), drafts through its cache,
maps draft ids to target ids, saves the same layout, and every mismatch is a one-line refusal.

The tensor names and shapes below are the published ones (SafeAILab/EAGLE eagle/model/cnets.py,
traineagle3/cnets.py and config.json; vLLM and SGLang llama_eagle3.py), not taken from our code.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_model
from viasd_core.speculation.eagle_files import load_feature_head, save_feature_head
from viasd_core.errors import ViasdError

H, HEADS, KV_HEADS, D, INTER = 64, 4, 2, 16, 96  # the head's geometry (the tiny target's hidden size, its own MLP)
VOCAB, DRAFT_VOCAB = 256, 40
N_LAYERS = 8  # target layers: the default feature layers are (2, 8 // 2, 8 - 3) = (2, 4, 5)

# The published config.json (EAGLE's traineagle3/config.json) scaled down; no rope_theta, as there.
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": H, "initializer_range": 0.02, "intermediate_size": INTER, "max_position_embeddings": 2048,
    "model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1,
    "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.28.1", "use_cache": True, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
}

CALLS: list[str] = []


def _record(tag: str) -> str:
    CALLS.append(tag)
    return tag


class Payload:
    """Unpickling this calls `_record`: a stand-in for a checkpoint that runs code when loaded."""

    def __reduce__(self):
        return (_record, ("unpickled",))


def published_tensors(seed: int = 0, draft_vocab: int = DRAFT_VOCAB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    hot = torch.sort(torch.randperm(VOCAB, generator=g)[:draft_vocab]).values  # target ids the head proposes
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[hot] = True
    return {
        "fc.weight": w(H, 3 * H, scale=0.05),
        "midlayer.input_layernorm.weight": 1 + w(H),
        "midlayer.hidden_norm.weight": 1 + w(H),
        "midlayer.self_attn.q_proj.weight": w(HEADS * D, 2 * H, scale=0.15),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * D, 2 * H, scale=0.15),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * D),
        "midlayer.post_attention_layernorm.weight": 1 + w(H),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": 1 + w(H),
        "lm_head.weight": w(draft_vocab, H, scale=0.3),
        "d2t": hot - torch.arange(draft_vocab),  # target id = draft index + d2t[draft index]
        "t2d": t2d,
    }


def write_head(folder, tensors=None, config=None, fmt="safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG if config is None else config), encoding="utf-8")
    tensors = published_tensors() if tensors is None else tensors
    if fmt == "safetensors":
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        torch.save(tensors, folder / "pytorch_model.bin")
    return folder


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", n_layers=N_LAYERS, seed=4)


def target_features(target, ids: torch.Tensor, layers=(2, 4, 5)) -> torch.Tensor:
    """The inputs of decoder layers `layers` (transformers' hidden_states[l]), concatenated: [T, 3H]."""
    with torch.no_grad():
        states = target(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([states[layer][0] for layer in layers], dim=-1)


# ---------------------------------------------------------------------- the reference, by hand
def rms(x, weight, eps=1e-5):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """Llama RoPE on x [heads, T, D]: rotate the pairs (i, i + D/2) by position * theta^(-2i/D)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = positions[:, None].double() * inv_freq[None]  # [T, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference(t, embed_weight, token_ids, fused, theta=10000.0):
    """The head on positions 0..T-1 at once, float64: logits [T, draft_vocab], hidden [T, H]."""
    t = {k: v.double() for k, v in t.items() if v.dtype.is_floating_point}
    T = token_ids.shape[0]
    emb = embed_weight.double()[token_ids]
    x = torch.cat([rms(emb, t["midlayer.input_layernorm.weight"]), rms(fused, t["midlayer.hidden_norm.weight"])], -1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(T, HEADS, D).transpose(0, 1)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(T, KV_HEADS, D).transpose(0, 1)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(T, KV_HEADS, D).transpose(0, 1)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    positions = torch.arange(T)
    q, k = rope(q, positions, theta), rope(k, positions, theta)
    scores = q @ k.transpose(1, 2) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, HEADS * D)
    h = fused + o @ t["midlayer.self_attn.o_proj.weight"].T
    m = rms(h, t["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T))
    hidden = h + mlp @ t["midlayer.mlp.down_proj.weight"].T
    return rms(hidden, t["norm.weight"]) @ t["lm_head.weight"].T, hidden


def fused_reference(t, features):
    return features.double() @ t["fc.weight"].double().T


# ---------------------------------------------------------------------- loading and the forward
@pytest.mark.parametrize("theta", [None, 1000.0])
def test_published_layout_loads_and_matches_the_hand_written_layer(tmp_path, target, theta):
    config = CONFIG if theta is None else {**CONFIG, "rope_theta": theta}
    tensors = published_tensors()
    embed = target.get_input_embeddings()
    head = load_feature_head(write_head(tmp_path / "head", tensors, config), target.config, embed=embed, max_len=64)
    assert head.feature_layers == (2, 4, 5)
    assert head.fc.weight.shape == (H, 3 * H)
    assert head.midlayer.self_attn.q_proj.weight.shape == (HEADS * D, 2 * H)
    assert head.lm_head.weight.shape == (DRAFT_VOCAB, H)
    assert head.embedding is embed and "embed_tokens.weight" not in head.state_dict()  # shared, not copied

    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    features = target_features(target, ids)
    # EAGLE's alignment: the feature of position i goes with the token at i + 1.
    tokens, feats = ids[1:], features[:-1]
    T = tokens.shape[0]
    ref_logits, ref_hidden = reference(tensors, embed.weight, tokens, fused_reference(tensors, feats),
                                       theta=10000.0 if theta is None else theta)

    logits, hidden = head.forward(tokens, feats, 0)
    assert logits.dtype == torch.float32 and logits.shape == (T, DRAFT_VOCAB) and hidden.shape == (T, H)
    torch.testing.assert_close(logits, ref_logits.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden.float(), rtol=1e-4, atol=1e-4)

    # Through the cache: a prefill of 5, then one token at a time; then a rollback and a block of 4.
    head.reset()
    rows = [head.forward(tokens[:5], feats[:5], 0)[0]]
    rows += [head.forward(tokens[i : i + 1], feats[i : i + 1], i)[0] for i in range(5, T)]
    torch.testing.assert_close(torch.cat(rows), logits, rtol=1e-5, atol=1e-5)
    head.rollback(7)
    assert head.seen == 7
    with pytest.raises(ValueError, match="leaves a gap"):  # position 7 was rolled back: 8 cannot come next
        head.forward(tokens[8:9], feats[8:9], 8)
    block, _ = head.forward(tokens[7:], head.fuse(feats[7:]), 7, n_logits=T - 7)  # already fused: [T, H]
    torch.testing.assert_close(block, logits[7:], rtol=1e-5, atol=1e-5)
    assert head.seen == T


def test_drafting_feeds_the_heads_own_feature_back(tmp_path, target):
    tensors = published_tensors(seed=2)
    embed = target.get_input_embeddings()
    head = load_feature_head(write_head(tmp_path / "head", tensors), target.config, embed=embed, max_len=32)
    ids = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(3))
    feats = target_features(target, ids)[:-1]
    tokens = ids[1:]
    logits, hidden = head.forward(tokens, feats, 0)
    fused = fused_reference(tensors, feats)
    for _ in range(3):  # three draft steps: the next token from the head, its own pre-norm output as the feature
        nxt = head.to_target_ids(logits[-1].argmax()).reshape(1)
        pos = tokens.shape[0]
        logits, step_hidden = head.forward(nxt, hidden[-1:], pos)
        tokens = torch.cat([tokens, nxt])
        fused = torch.cat([fused, hidden[-1:].double()])
        ref_logits, ref_hidden = reference(tensors, embed.weight, tokens, fused)
        torch.testing.assert_close(logits[0], ref_logits[-1].float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step_hidden[0], ref_hidden[-1].float(), rtol=1e-4, atol=1e-4)
        hidden = step_hidden


# What each key's numbers mean (eagle_files.LAYER_KEYS): the top-level key names the layers whose
# inputs are read (vLLM takes it as it is); SGLang's eagle_config key and AngelSlim's trainer key name
# the layers whose outputs are read, the inputs of the next ones.
@pytest.mark.parametrize("where, layers", [("top", (0, 3, 6)), ("eagle_config", (1, 4, 7)), ("angelslim", (1, 4, 7))])
def test_feature_layers_named_in_the_config_are_read_in_layer_order(tmp_path, target, where, layers):
    # The target's layer loop appends the states in layer order, whatever order the config lists.
    ids = [6, 0, 3]
    config = {"top": {**CONFIG, "eagle_aux_hidden_state_layer_ids": ids},
              "eagle_config": {**CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}},
              "angelslim": {**CONFIG, "aux_hidden_states_layer_ids": ids}}[where]
    head = load_feature_head(write_head(tmp_path / "head", config=config), target.config,
                             embed=target.get_input_embeddings())
    assert head.feature_layers == layers


def test_both_spellings_of_the_same_layers_load_as_viasd_exports_them(tmp_path, target):
    config = {**CONFIG, "eagle_aux_hidden_state_layer_ids": [2, 4, 6],
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
    head = load_feature_head(write_head(tmp_path / "head", config=config), target.config,
                             embed=target.get_input_embeddings())
    assert head.feature_layers == (2, 4, 6)


def test_d2t_maps_draft_indices_to_target_ids(tmp_path, target):
    tensors = published_tensors(seed=5)
    head = load_feature_head(write_head(tmp_path / "head", tensors), target.config, embed=target.get_input_embeddings())
    hot = torch.nonzero(tensors["t2d"]).flatten()  # the target ids, ascending (EAGLE sorts them)
    assert torch.equal(head.to_target_ids(torch.arange(DRAFT_VOCAB)), hot)
    assert torch.equal(head.to_target_ids(torch.tensor([[0, DRAFT_VOCAB - 1]])), hot[[0, -1]][None])
    assert torch.equal(head.t2d, tensors["t2d"])


def test_full_vocabulary_head_needs_no_maps_and_own_embedding_is_used(tmp_path, target):
    tensors = published_tensors(seed=6, draft_vocab=VOCAB)
    del tensors["d2t"], tensors["t2d"]
    own = torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(7))
    tensors["embed_tokens.weight"] = own
    config = {k: v for k, v in CONFIG.items() if k != "draft_vocab_size"}
    head = load_feature_head(write_head(tmp_path / "head", tensors, config), target.config, max_len=16)
    assert torch.equal(head.to_target_ids(torch.arange(VOCAB)), torch.arange(VOCAB))
    ids = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(8))
    feats = target_features(target, ids)
    logits, _ = head.forward(ids, feats, 0)
    ref_logits, _ = reference(tensors, own, ids, fused_reference(tensors, feats))
    torch.testing.assert_close(logits, ref_logits.float(), rtol=1e-4, atol=1e-4)


def test_pytorch_bin_loads_like_safetensors(tmp_path, target):
    embed = target.get_input_embeddings()
    a = load_feature_head(write_head(tmp_path / "st"), target.config, embed=embed, max_len=16)
    b = load_feature_head(write_head(tmp_path / "bin", fmt="bin"), target.config, embed=embed, max_len=16)
    ids = torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(9))
    feats = target_features(target, ids)
    assert torch.equal(a.forward(ids, feats, 0)[0], b.forward(ids, feats, 0)[0])


def test_pickle_with_a_custom_class_is_refused_without_running_it(tmp_path, target):
    tensors = {**published_tensors(), "extra": Payload()}
    folder = write_head(tmp_path / "head", tensors, fmt="bin")
    CALLS.clear()
    with pytest.raises(ViasdError, match="holds objects other than tensors") as err:
        load_feature_head(folder, target.config, embed=target.get_input_embeddings())
    assert "\n" not in str(err.value)
    assert CALLS == []  # weights_only: the payload's code never ran


# ---------------------------------------------------------------------- refusals
def _set(**changes):
    return lambda config, tensors: config.update(changes)


def _tensor(name, value):
    return lambda config, tensors: tensors.__setitem__(name, value)


def _drop(name):
    return lambda config, tensors: tensors.pop(name)


def _bad_d2t(config, tensors):
    tensors["d2t"][-1] += VOCAB  # the last draft id maps past the vocabulary


def _bad_t2d(config, tensors):
    tensors["t2d"][int(torch.nonzero(~tensors["t2d"])[0])] = True  # marks an id no draft index maps to


REFUSALS = {
    "hidden size": (_set(hidden_size=32), "hidden size 32 does not match the target's 64"),
    "target hidden size": (_set(target_hidden_size=128), "hidden size 128 does not match the target's 64"),
    "vocab size": (_set(vocab_size=300), "vocab size 300 does not match the target's 256"),
    "draft vocab": (_set(draft_vocab_size=VOCAB + 1), "draft_vocab_size 257 exceeds"),
    "layer ids": (_set(eagle_aux_hidden_state_layer_ids=[2, 4, 8]), r"\[2, 4, 8\] are out of range: the target has 8 layers"),
    "nested layer ids": (_set(eagle_config={"eagle_aux_hidden_state_layer_ids": [-2, 2, 4]}),
                         r"eagle_config.eagle_aux_hidden_state_layer_ids \[-2, 2, 4\] \(layer outputs: the inputs of "
                         r"layers \[-1, 3, 5\]\) are out of range"),
    "angelslim layer ids": (_set(aux_hidden_states_layer_ids=[1, 3, 7]),
                            r"aux_hidden_states_layer_ids \[1, 3, 7\] \(layer outputs: the inputs of layers "
                            r"\[2, 4, 8\]\) are out of range: the target has 8 layers"),
    "disagreeing layer ids": (_set(eagle_aux_hidden_state_layer_ids=[2, 4, 6],
                                   eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}),
                              r"\[2, 4, 6\] \(inputs of layers \[2, 4, 6\]\) and eagle_config.eagle_aux_hidden_state_layer_ids "
                              r"\[2, 4, 6\] \(inputs of layers \[3, 5, 7\]\) name different target layers"),
    "repeated layer ids": (_set(eagle_aux_hidden_state_layer_ids=[2, 2, 4]), "not three distinct"),
    "two layers": (_set(num_hidden_layers=2), "only one-layer"),
    "dynamic rope": (_set(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic' is not supported"),
    "missing tensor": (_drop("midlayer.hidden_norm.weight"), "missing tensors midlayer.hidden_norm.weight"),
    "missing map": (_drop("d2t"), "missing tensors d2t"),
    "unexpected tensor": (_tensor("midlayer.self_attn.q_proj.bias", torch.zeros(HEADS * D)),
                          r"unexpected tensors midlayer.self_attn.q_proj.bias \(not the EAGLE-3 layout\)"),
    "q_proj reads H": (_tensor("midlayer.self_attn.q_proj.weight", torch.zeros(HEADS * D, H)),
                       r"'midlayer.self_attn.q_proj.weight' has shape \[64, 64\], expected \[64, 128\]"),
    "fc of two states": (_tensor("fc.weight", torch.zeros(H, 2 * H)), r"'fc.weight' has shape \[64, 128\], expected \[64, 192\]"),
    "float d2t": (lambda c, t: t.__setitem__("d2t", t["d2t"].float()), "'d2t' has dtype torch.float32"),
    "d2t range": (_bad_d2t, "d2t maps draft ids outside the target vocabulary"),
    "t2d disagrees": (_bad_t2d, "t2d does not mark exactly the target ids that d2t maps to"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_mismatches_are_one_line_refusals(tmp_path, target, case):
    mutate, message = REFUSALS[case]
    config, tensors = json.loads(json.dumps(CONFIG)), published_tensors()
    mutate(config, tensors)
    folder = write_head(tmp_path / "head", tensors, config)
    with pytest.raises(ViasdError, match=message) as err:
        load_feature_head(folder, target.config, embed=target.get_input_embeddings())
    assert "\n" not in str(err.value)


def test_default_layers_of_a_shallow_target_are_refused(tmp_path):
    shallow = tiny_model("llama", n_layers=4)  # (2, 4 // 2, 4 - 3) = (2, 2, 1): not three layers
    with pytest.raises(ViasdError, match=r"\(2, 2, 1\) of this 4-layer target are not three distinct"):
        load_feature_head(write_head(tmp_path / "head"), shallow.config, embed=shallow.get_input_embeddings())


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("case, damage, message", [
    ("truncated safetensors", lambda f: _truncate(f / "model.safetensors"), "model.safetensors is damaged or truncated"),
    ("config not JSON", lambda f: (f / "config.json").write_text('{"hidden_size": 64,', encoding="utf-8"),
     "config.json is not valid JSON"),
    ("config not an object", lambda f: (f / "config.json").write_text("[1, 2]", encoding="utf-8"), "is not a JSON object"),
    ("no config", lambda f: (f / "config.json").unlink(), "has no config.json"),
    ("no weights", lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors or pytorch_model.bin"),
])
def test_damaged_folders_are_one_line_refusals(tmp_path, target, case, damage, message):
    folder = write_head(tmp_path / "head")
    damage(folder)
    with pytest.raises(ViasdError, match=message) as err:
        load_feature_head(folder, target.config, embed=target.get_input_embeddings())
    assert "\n" not in str(err.value)


def test_truncated_bin_and_missing_embedding_are_refused(tmp_path, target):
    folder = write_head(tmp_path / "bin", fmt="bin")
    _truncate(folder / "pytorch_model.bin")
    with pytest.raises(ViasdError, match="pytorch_model.bin is damaged or not a PyTorch file"):
        load_feature_head(folder, target.config, embed=target.get_input_embeddings())
    with pytest.raises(ViasdError, match="has no embed_tokens.weight: pass the target's input embedding"):
        load_feature_head(write_head(tmp_path / "st"), target.config)


def test_context_past_the_allocation_is_a_one_line_error(tmp_path, target):
    head = load_feature_head(write_head(tmp_path / "head"), target.config, embed=target.get_input_embeddings(), max_len=4)
    ids = torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(10))
    with pytest.raises(ViasdError, match="exceeds the 4 positions allocated"):
        head.forward(ids, target_features(target, ids), 0)


# ---------------------------------------------------------------------- saving
def test_save_writes_the_published_layout_atomically_and_round_trips(tmp_path, target):
    tensors = published_tensors(seed=11)
    embed = target.get_input_embeddings()
    head = load_feature_head(write_head(tmp_path / "src", tensors), target.config, embed=embed, max_len=16)
    out = tmp_path / "saved" / "head"
    out.mkdir(parents=True)
    (out / "stale.txt").write_text("replaced")  # an existing folder is replaced whole
    assert save_feature_head(head, out) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["head"]  # no temporary folder left
    assert json.loads((out / "config.json").read_text(encoding="utf-8")) == CONFIG
    stored = load_file(str(out / "model.safetensors"))
    assert set(stored) == set(tensors)  # exactly the published names: no embedding, no cache
    for name, value in tensors.items():
        assert stored[name].dtype == value.dtype and torch.equal(stored[name], value), name
    again = load_feature_head(out, target.config, embed=embed, max_len=16)
    ids = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(12))
    feats = target_features(target, ids)
    assert torch.equal(again.forward(ids, feats, 0)[0], head.forward(ids, feats, 0)[0])


def test_drafting_calls_take_the_norm_kernel_and_agree_with_the_traced_calls(tmp_path, target):
    """The head's calls are bound when it allocates and again after a cast (head_calls.bind): a
    bfloat16 head's four eager RMSNorms are the C kernel where it builds here, bound to the
    bfloat16 weights, its traced ones the modules; eager drafts agree with the traced calls' within
    a bfloat16 step's drift."""
    from viasd_kernels import cpu_rms_norm
    from viasd_core import paths

    head = load_feature_head(write_head(tmp_path / "head", published_tensors(seed=4)), target.config,
                             embed=target.get_input_embeddings(), max_len=32)
    float_calls = head.eager_calls
    head.to(torch.bfloat16)  # after allocate: bound again
    assert head.eager_calls is not float_calls
    eager, traced = head.eager_calls, head.traced_calls
    layer = head.midlayer
    modules = {"input_norm": layer.input_layernorm, "hidden_norm": layer.hidden_norm,
               "post_norm": layer.post_attention_layernorm, "final_norm": head.norm}
    kernel = cpu_rms_norm.bind(head.norm.weight.detach(), 1e-5, build_dir=paths.kernel_dir()) is not None
    for name, module in modules.items():
        assert getattr(traced, name) == module.forward
        assert (getattr(eager, name) != module.forward) == kernel, name
        if kernel:
            assert getattr(eager, name).dtype == torch.bfloat16
    ids = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(5))
    feats = target_features(target, ids)[:-1].to(torch.bfloat16)
    got, hidden = head.forward(ids[1:], feats, 0)
    head.__dict__["eager_calls"] = traced  # PyTorch's operators throughout
    head.reset()
    want, want_hidden = head.forward(ids[1:], feats, 0)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    torch.testing.assert_close(hidden, want_hidden, rtol=0.05, atol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
