"""A tiny Llama written as a GGUF file, the way llama.cpp's converter lays one out (tensor names, Q/K
rows permuted for its RoPE, a GPT-2 byte-level tokenizer, a chat template), with float32 tensors so
that what viasd converts back can be compared with the model it came from, value for value; or with
the decoder's linear layers in a block type (Q4_0, Q4_1, Q8_0 through gguf.quants; Q4_K through
`quantize_q4_k`, which gguf.quants does not write)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, bos, eos (as SmolLM2)
MERGES = ["h e", "l l", "he ll"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (tokenizers' ByteLevel alphabet), in byte order."""
    chars = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in chars:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tokens() -> list[str]:
    return SPECIALS + _byte_alphabet() + ["he", "ll", "hell"]


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q_proj/k_proj rows (transformers undoes it on load)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """weights [n, k] (k a multiple of 256) as Q4_K bytes [n, k / 256 * 144]: per sub-block of 32 a
    6-bit scale and min (gguf.quants.Q4_K.get_scale_min's layout, inverted), codes by rounding. Not
    llama.cpp's search for the best scales: any valid blocks serve the tests."""
    n, k = weights.shape
    w = weights.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(w.min(-1), 0.0)  # w = d * sc * q - dmin * mn with mn >= 0
    span = np.maximum(w.max(-1) - lo, 1e-8) / 15
    d = (span.max(-1) / 63).astype(np.float16)
    dmin = np.maximum((-lo).max(-1) / 63, 1e-8).astype(np.float16)  # mins: -lo >= 0
    sc = np.clip(np.round(span / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((w + offset[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                                    (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=-1)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # chunk c: sub-block 2c low, 2c + 1 high
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed_scales, qs], axis=-1)
    return blocks.reshape(n, -1)


def quantize(weights: np.ndarray, qtype) -> np.ndarray:
    """`weights` [n, k] as the bytes of block type `qtype` (a gguf.GGMLQuantizationType)."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(weights)
    return gguf.quants.quantize(weights.astype(np.float32), qtype)


def write_tiny_gguf(path: Path, seed: int = 7, n_layers: int = 2, qtype=None, head_qtype=None, **extra):
    """Write a tiny random Llama as a GGUF file at `path`; returns the transformers model it holds.
    `qtype` (a gguf.GGMLQuantizationType): the decoder's linear layers in that block type (the
    model returned keeps the float weights they were quantized from); `head_qtype`: the output head
    (`output.weight`) in that block type; `extra`: config fields."""
    import gguf
    from conftest import tiny_model

    vocab = len(tokens())
    model = tiny_model("llama", n_layers=n_layers, seed=seed, vocab=vocab, **extra)
    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(n_layers)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_rope_dimension_count(cfg.hidden_size // n_head)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens())
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (vocab - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if head_qtype is None:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    else:
        writer.add_tensor("output.weight", quantize(state["lm_head.weight"], head_qtype), raw_dtype=head_qtype)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        names = {
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
        }
        for short, long in names.items():
            weights = state[p + long + ".weight"]
            if short == "attn_q":
                weights = _permute(weights, n_head)
            elif short == "attn_k":
                weights = _permute(weights, n_kv)
            weights = np.ascontiguousarray(weights)
            if qtype is None or short.endswith("norm"):
                writer.add_tensor(f"blk.{i}.{short}.weight", weights)
            else:
                writer.add_tensor(f"blk.{i}.{short}.weight", quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
