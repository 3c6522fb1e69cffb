"""Engines over tiny models and their references, shared by the engine's tests (a helper module,
not a test file): transformers' own greedy generation, an engine with a model, n-gram or no drafter
(and a slim view), a prompt per seed, and the count of graphs torch.compile has made."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from conftest import TinyTokenizer
from viasd_core.speculation.drafters import ModelDrafter, NgramDrafter
from viasd_core.speculation.engine import Engine
from viasd_core.runtime.model import FastModel

NEW = 40


def hf_greedy(model, prompt, max_new, eos=None):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=0, do_sample=False,
            eos_token_id=eos, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def make_engine(target, draft_model=None, ngram=False, eos=(), slim_layers=None):
    fast = FastModel(target, max_len=128)
    drafter = None
    if draft_model is not None:
        drafter = ModelDrafter(FastModel(draft_model, max_len=128, name="draft"), vocab_size=fast.shape.vocab_size)
    elif ngram:
        drafter = NgramDrafter()
    slim = FastModel(target, layer_ids=slim_layers, max_len=128, name="slim") if slim_layers else None
    return Engine(fast, TinyTokenizer(), drafter=drafter, slim=slim, eos_token_ids=set(eos))


def prompt_for(seed, length=12, base=100):
    """A prompt of `length` tokens drawn from seed `base + seed`."""
    g = torch.Generator().manual_seed(base + seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]
