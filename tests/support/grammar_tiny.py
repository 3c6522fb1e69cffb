"""A tiny byte-level tokenizer that can spell any text (JSON, tool calls), and a model folder with it
and a Qwen-style chat template that lays out `tools`: what the constrained-decoding tests need (the
shared tiny tokenizer is a word list, which cannot spell JSON)."""

from __future__ import annotations

from conftest import tiny_model

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
MERGES = [("{", '"'), ('"', ":"), ('"', ","), ('"', "}"), ("Ġ", '"')]  # a few multi-byte tokens, as real BPEs have
VOCAB = 272  # model rows: the tokenizer's 266 tokens plus padding rows (as Qwen pads its vocabulary)
EOS = 2  # </s>
IM_END = 4

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS + alphabet + ["".join(m) for m in MERGES])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=SPECIALS[3:])
    fast.chat_template = TOOLS_TEMPLATE
    return fast


def save_byte_model_dir(folder, n_layers=4, seed=0):
    model = tiny_model("qwen2", n_layers=n_layers, seed=seed, vocab=VOCAB, max_position_embeddings=2048)
    model.generation_config.eos_token_id = [EOS, IM_END]
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder
