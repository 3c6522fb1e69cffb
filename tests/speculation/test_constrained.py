"""Constrained decoding (grammar.py, steps.constrained_step): every answer matches its grammar, and
constrained sd emits exactly constrained ar's tokens (greedy) whatever the draft proposes."""

import json
import re

import jsonschema
import pytest
import torch

from conftest import tiny_model
from support.grammar_tiny import EOS, IM_END, VOCAB, byte_tokenizer
from viasd_core.speculation.drafters import ModelDrafter, NgramDrafter
from viasd_core.speculation.hybrid_drafter import HybridDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.speculation.grammar import Grammar
from viasd_core.runtime.model import FastModel
from viasd_core.errors import ViasdError

SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["city", "n", "ok"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{1,3}!"
GBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
GRAMMARS = {"schema": Grammar.json_schema(SCHEMA), "regex": Grammar("regex", REGEX), "gbnf": Grammar("gbnf", GBNF)}
PROMPTS = ["Give me a city as JSON:", "w1 w2 {\"city\": 3", "answer"]


@pytest.fixture(scope="module")
def models():
    return tiny_model("qwen2", seed=41, vocab=VOCAB), tiny_model("qwen2", n_layers=1, seed=42, vocab=VOCAB)


def engine(target, draft=None, kind="model"):
    fast = FastModel(target, max_len=256)
    drafter = None
    if kind == "ngram":
        drafter = NgramDrafter()
    elif draft is not None:
        drafter = ModelDrafter(FastModel(draft, max_len=256, name="draft"), vocab_size=fast.shape.vocab_size)
        if kind == "hybrid":
            drafter = HybridDrafter(drafter)
    return Engine(fast, byte_tokenizer(), drafter=drafter, eos_token_ids={EOS, IM_END})


def ids(text):
    return byte_tokenizer()(text).input_ids


def check(name, gen):
    """The answer (EOS excluded) matches its grammar in full."""
    assert gen.finish_reason == "eos", (name, gen.text, gen.finish_reason)
    text = byte_tokenizer().decode(gen.tokens[:-1])
    if name == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", text), text


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_constrained_sd_emits_constrained_ar_tokens(models, name):
    target, draft = models
    for prompt in PROMPTS:
        config = dict(max_new_tokens=80, grammar=GRAMMARS[name])
        ar = engine(target).generate(ids(prompt), GenerationConfig(mode="ar", **config))
        check(name, ar)
        free = engine(target).generate(ids(prompt), GenerationConfig(mode="ar", max_new_tokens=len(ar.tokens)))
        assert free.tokens != ar.tokens  # a random model left alone writes no such thing: the mask did it
        for kind, drafter_model, gamma in (("model", draft, 4), ("model", target, 3), ("ngram", None, 4),
                                           ("hybrid", draft, 5)):
            sd = engine(target, drafter_model, kind).generate(
                ids(prompt), GenerationConfig(mode="sd", gamma=gamma, adaptive=False, **config))
            assert sd.tokens == ar.tokens, (name, prompt, kind, gamma)
            if drafter_model is target:  # the draft's logits are masked too: it proposes what the target emits
                assert sd.stats.acceptance_rate == 1.0, (name, prompt)


def test_sampled_answers_match_the_grammar_and_repeat_with_their_seed(models):
    target, draft = models
    for seed in range(3):
        config = GenerationConfig(mode="sd", gamma=4, adaptive=False, max_new_tokens=80, temperature=1.0, seed=seed,
                                  grammar=GRAMMARS["schema"])
        first = engine(target, draft).generate(ids(PROMPTS[0]), config)
        check("schema", first)
        assert engine(target, draft).generate(ids(PROMPTS[0]), config).tokens == first.tokens
        check("regex", engine(target).generate(ids(PROMPTS[1]), GenerationConfig(
            mode="ar", max_new_tokens=40, temperature=1.0, seed=seed, grammar=GRAMMARS["regex"])))


def test_a_cut_answer_ends_on_length_and_the_next_generation_is_free(models):
    target, draft = models
    eng = engine(target, draft)
    cut = eng.generate(ids(PROMPTS[0]), GenerationConfig(mode="sd", gamma=4, max_new_tokens=3, grammar=GRAMMARS["schema"]))
    assert cut.finish_reason == "length" and len(cut.tokens) == 3 and cut.text.startswith("{")
    free = eng.generate(ids(PROMPTS[0]), GenerationConfig(mode="sd", gamma=4, max_new_tokens=20))
    assert free.tokens == engine(target, draft).generate(ids(PROMPTS[0]), GenerationConfig(mode="ar", max_new_tokens=20)).tokens


@pytest.mark.parametrize("grammar, words", [
    (Grammar("regex", "a("), "regex grammar is not valid"),
    (Grammar("json_schema", '{"type": 5}'), "json_schema grammar is not valid"),
    (Grammar("gbnf", "root ::= ("), "gbnf grammar is not valid"),
])
def test_a_bad_grammar_is_a_one_line_error(models, grammar, words):
    with pytest.raises(ViasdError, match=words) as e:
        engine(models[0]).generate(ids("x"), GenerationConfig(mode="ar", max_new_tokens=4, grammar=grammar))
    assert "\n" not in e.value.message


def test_the_mask_allows_exactly_what_the_grammar_allows():
    from viasd_core.speculation.grammar import Constraint

    tok = byte_tokenizer()
    c = Constraint(Grammar("regex", "ab|ac"), tok, VOCAB, {EOS}, torch.device("cpu"))
    first = c.allowed(1)[0]
    assert first.shape == (VOCAB,) and first.nonzero().flatten().tolist() == tok.convert_tokens_to_ids(["a"])
    assert c.follow(tok.convert_tokens_to_ids(["a", "c", "a"])) == 2  # 'a', 'c' allowed, then only EOS
    rows = c.allowed(3)
    assert sorted(rows[1].nonzero().flatten().tolist()) == sorted(tok.convert_tokens_to_ids(["b", "c"]))
    assert rows[2].nonzero().flatten().tolist() == [EOS]
    c.commit(tok.convert_tokens_to_ids(["a"]))  # the step emitted 'a' only: the tail is gone
    assert c.pushed == 0 and sorted(c.allowed(1)[0].nonzero().flatten().tolist()) == sorted(
        tok.convert_tokens_to_ids(["b", "c"]))
