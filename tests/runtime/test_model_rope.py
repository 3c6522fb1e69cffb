"""RoPE types and family features of FastModel against the transformers forward.

FastModel builds one cos/sin table for all positions, so it is exact only for RoPE types whose
frequencies the sequence length does not change (default, linear, llama3, yarn: checked here on
the installed transformers); dynamic and longrope run up to the context where they are one table
(tests/loading/test_rope_lengths.py), and an EAGLE head refuses them in one line. Every
feature runs on sequences past what it needs (past original_max_position_embeddings for the
scaled types, past the window for Mistral), prefilled AND fed token by token through the cache.
"""

import json

import pytest
import torch

from conftest import tiny_model
from viasd_core.errors import ViasdError
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.rope import STATIC_ROPE_TYPES, apply_rope, apply_rope_reference, signed_sin

ORIGINAL = 16  # original_max_position_embeddings of the scaled types
N = 40  # sequence length: well past ORIGINAL
PREFILL = 10  # below ORIGINAL: the token-by-token part crosses it

ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL, "rope_theta": 100000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                 "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0},
}


def rope_model(rope_type: str, seed: int = 0, **extra):
    # max_position_embeddings above ORIGINAL so that yarn / longrope really scale (factor from the ratio)
    return tiny_model("llama", seed=seed, max_position_embeddings=4 * ORIGINAL,
                      rope_parameters=dict(ROPES[rope_type]), **extra)


def assert_matches_transformers(model, n: int = N, prefill: int = PREFILL, seed: int = 5):
    """FastModel == transformers on `n` tokens: prefill then one token at a time; then one whole pass."""
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = model(ids[None]).logits[0].float()
    fast = FastModel(model, max_len=n + 8)
    stepped = torch.cat([fast.forward(ids[:prefill], 0, prefill)] + [fast.forward(ids[i : i + 1], i, 1) for i in range(prefill, n)])
    torch.testing.assert_close(stepped, ref, rtol=1e-4, atol=1e-4)
    fast.reset()
    torch.testing.assert_close(fast.forward(ids, 0, n), ref, rtol=1e-4, atol=1e-4)
    return fast


def reference_table(model, rope_type: str, n: int):
    """cos/sin for positions [0, n) straight from transformers' RoPE init function."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](model.config, None)
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None].float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


# ---------------------------------------------------------------------- supported types
@pytest.mark.parametrize("rope_type", ["linear", "llama3", "yarn"])
def test_scaled_rope_matches_transformers_past_the_original_length(rope_type):
    model = rope_model(rope_type, seed=11)
    fast = assert_matches_transformers(model)
    # Our table is transformers' RoPE for every position, and the scaling really changes it.
    cos, sin = reference_table(model, rope_type, N)
    torch.testing.assert_close(fast.cache.cos[:N], cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.cache.sin_signed[:N], signed_sin(sin), rtol=1e-5, atol=1e-5)
    plain = FastModel(tiny_model("llama", seed=11, rope_parameters={"rope_type": "default", "rope_theta": ROPES[rope_type]["rope_theta"]}), max_len=N)
    assert (plain.cache.cos[ORIGINAL:N] - fast.cache.cos[ORIGINAL:N]).abs().max() > 0.1


@pytest.mark.parametrize("rope_type", list(STATIC_ROPE_TYPES) + ["dynamic", "longrope"])
def test_supported_types_are_exactly_the_length_independent_ones(rope_type):
    # In the installed transformers: a supported type's frequencies do not depend on the sequence
    # length (one table is right for every position); dynamic and longrope's do.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = tiny_model("llama", max_position_embeddings=4 * ORIGINAL) if rope_type == "default" else rope_model(rope_type)
    init = ROPE_INIT_FUNCTIONS.get(rope_type) or model.model.rotary_emb.compute_default_rope_parameters
    short, short_scale = init(model.config, device=None, seq_len=ORIGINAL // 2)
    long, long_scale = init(model.config, device=None, seq_len=16 * ORIGINAL)
    static = torch.equal(short, long) and short_scale == long_scale
    assert static == (rope_type in STATIC_ROPE_TYPES)


# ---------------------------------------------------------------------- length-dependent types
@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_runs_up_to_its_original_context_only(rope_type):
    from viasd_core.runtime.rope import check_rope

    model = rope_model(rope_type, seed=3)
    context = ORIGINAL if rope_type == "longrope" else 4 * ORIGINAL  # dynamic: max_position_embeddings
    fast = assert_matches_transformers(model, n=context, prefill=context // 2)
    assert fast.shape.max_positions == context  # dynamic's is the config's own: nothing to say
    assert (f"'{rope_type}'" in fast.shape.positions_why) == (rope_type == "longrope")
    with pytest.raises(ViasdError) as info:  # what an EAGLE head's config is held to
        check_rope(model.config)
    message = info.value.message
    assert "\n" not in message
    assert f"'{rope_type}'" in message and "sequence length" in message
    assert "supported: default, linear, llama3, yarn" in message


def saved_model_dir(folder, rope_parameters):
    """A tiny Llama folder (config, safetensors, tokenizer) whose config.json has these RoPE parameters."""
    from conftest import save_tiny_model_dir

    save_tiny_model_dir(folder, n_layers=1)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = rope_parameters
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("rope_parameters, expected", [
    ({"rope_type": "rotor", "rope_theta": 10000.0}, "RoPE type 'rotor' is not supported (viasd does not know it)"),
    ({"rope_type": "llama3", "rope_theta": 10000.0}, "could not load model"),  # keys missing: transformers' KeyError
], ids=["unknown", "incomplete"])
def test_loading_a_model_with_a_bad_rope_is_a_one_line_error(tmp_path, rope_parameters, expected):
    from viasd_core.loading.models import load_model

    folder = saved_model_dir(tmp_path / "m", rope_parameters)
    with pytest.raises(ViasdError) as info:
        load_model(str(folder), device="cpu")
    assert expected in info.value.message and "\n" not in info.value.message


def test_cli_reports_an_unknown_rope_type_in_one_line(tmp_path, viasd_home):
    from typer.testing import CliRunner

    from viasd_cli.app import get_app

    folder = saved_model_dir(tmp_path / "m", {"rope_type": "rotor", "rope_theta": 10000.0})
    r = CliRunner().invoke(get_app(), ["generate", "-m", str(folder), "--mode", "ar", "-n", "2", "w1 w2"])
    assert r.exit_code == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "RoPE type 'rotor' is not supported" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------- family features
def test_mistral_sliding_window_past_the_window():
    model = tiny_model("mistral", seed=3, sliding_window=6)
    fast = assert_matches_transformers(model, prefill=4)
    assert fast.windows == [6] * 4


def test_qwen3_qk_norm():
    model = tiny_model("qwen3", seed=4, head_dim=16)
    with torch.no_grad():  # non-trivial norm weights: a forward that skipped them would differ
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
            layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    assert_matches_transformers(model)


def test_gemma_scaled_embedding():
    model = tiny_model("gemma", seed=6)
    assert float(model.model.embed_tokens.embed_scale) == pytest.approx(64 ** 0.5)
    assert_matches_transformers(model)


def test_gemma_without_the_embedding_scale_is_refused():
    # transformers < 5.4 scales Gemma's embeddings in GemmaModel.forward, which FastModel skips:
    # an embedding module without the scale would be wrong from position 0, so it is refused.
    model = tiny_model("gemma", seed=6)
    scaled = model.model.embed_tokens
    plain = torch.nn.Embedding(scaled.num_embeddings, scaled.embedding_dim)
    plain.weight = scaled.weight
    model.model.embed_tokens = plain
    with pytest.raises(ViasdError, match=r"Gemma .* no sqrt\(hidden\) scale .* transformers to 5\.4"):
        FastModel(model, max_len=N)


# ---------------------------------------------------------------------- draft configs
def llama3_target():
    return rope_model("llama3", seed=12)


def test_draft_of_a_llama3_target_has_the_targets_rope_tables(tmp_path):
    from viasd_core.loading.draft_model import build_draft, draft_llama_config, load_draft, save_draft

    target = llama3_target()
    target_fast = FastModel(target, max_len=N)
    draft = build_draft(draft_llama_config(target.config, 1), 32, target.get_input_embeddings()).eval()

    class Vocab:  # save_draft only fingerprints the vocabulary
        def get_vocab(self):
            return {f"t{i}": i for i in range(target.config.vocab_size)}

    folder = save_draft(tmp_path / "draft", draft, torch.arange(32), Vocab(), target="t")
    saved = json.loads((folder / "config.json").read_text())["llama_config"]
    # Both spellings: rope_parameters (transformers 5) and rope_theta / rope_scaling (transformers 4).
    assert saved["rope_theta"] == 100000.0
    assert saved["rope_scaling"]["rope_type"] == "llama3" and saved["rope_scaling"]["factor"] == 8.0
    assert saved["rope_scaling"]["original_max_position_embeddings"] == ORIGINAL
    assert saved["rope_parameters"]["rope_type"] == "llama3" and saved["rope_parameters"]["rope_theta"] == 100000.0

    loaded = load_draft(folder, target)
    legacy = {k: v for k, v in saved.items() if k != "rope_parameters"}  # what transformers 4 reads
    legacy_draft = build_draft(legacy, 32, target.get_input_embeddings())
    for model in (draft, loaded, legacy_draft):
        fast = FastModel(model, max_len=N, name="draft")
        torch.testing.assert_close(fast.cache.cos, target_fast.cache.cos, rtol=0, atol=0)
        torch.testing.assert_close(fast.cache.sin_signed, target_fast.cache.sin_signed, rtol=0, atol=0)


# ---------------------------------------------------------------------- the rotation
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rolled_rotation_is_transformers_bit_for_bit(dtype):
    """apply_rope over the signed sine table gives exactly transformers' x * cos + rotate_half(x) * sin."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 9, 7, 64, generator=g).to(dtype), torch.randn(1, 3, 7, 64, generator=g).to(dtype)
    angles = torch.randn(7, 32, generator=g) * 40
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    for x in (q, k):
        assert torch.equal(apply_rope(x, cos, signed_sin(sin)), apply_rope_reference(x, cos, sin))
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    assert torch.equal(apply_rope(q, cos, signed_sin(sin)), want_q)
    assert torch.equal(apply_rope(k, cos, signed_sin(sin)), want_k)
