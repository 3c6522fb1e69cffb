"""Published Qwen3 EAGLE-3 heads (issue 50 part 4): a fake head of each layout they come in loads
for a tiny Qwen3 target, and the target's own passes capture the layers that layout names, checked
against transformers' output_hidden_states (index 0 = the embedding output, index i = the input of
decoder layer i).

The layouts, and what their layer numbers mean (eagle_files.LAYER_KEYS, from the engines' source):
  - AngelSlim's published heads (AngelSlim/Qwen3-*_eagle3) and Tengyunw's: EAGLE-3 names, a 32000-id
    draft vocabulary, no layer ids: the default (2, L//2, L-3), as vLLM and SGLang read them;
  - a top-level `eagle_aux_hidden_state_layer_ids` (vLLM, EAGLE-3, speculators): layer inputs;
  - `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang): layer outputs, one added;
  - `aux_hidden_states_layer_ids` (AngelSlim's trainer reads hidden_states[id + 1]): one added;
  - the speculators layout (`layers.0.*`, nested config, norm_before_residual): layer inputs.
No real Qwen3 weights are used: the heads are random, written with the published names and keys.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from support.qwen3_head_files import ANGELSLIM, VOCAB, head_tensors, write
from viasd_core.speculation.eagle_files import load_feature_head
from viasd_core.speculation.feature_drafter import FeatureDrafter
from viasd_core.speculation.head_layouts import speculators_config, speculators_tensors
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.sampling import Sampler, SamplingParams
from viasd_core.errors import ViasdError

N_LAYERS = 8  # the default layers of 8: (2, 4, 5)


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen3", n_layers=N_LAYERS, seed=7)


def angelslim_published(folder):
    return write(folder, ANGELSLIM, head_tensors(ANGELSLIM), fmt="bin")


def vllm_top_level(folder):
    return write(folder, ANGELSLIM | {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}, head_tensors(ANGELSLIM))


def sglang_eagle_config(folder):
    config = ANGELSLIM | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5], "use_aux_hidden_state": True}}
    return write(folder, config, head_tensors(ANGELSLIM))


def angelslim_trainer(folder):
    return write(folder, ANGELSLIM | {"aux_hidden_states_layer_ids": [1, 3, 5]}, head_tensors(ANGELSLIM))


def speculators(folder):
    flat = ANGELSLIM | {"norm_before_residual": True}
    config = speculators_config(flat, [1, 4, 6], speculative_tokens=3, verifier="Qwen/Qwen3-8B")
    return write(folder, config, speculators_tensors(head_tensors(ANGELSLIM)))


# layout -> (the files, the hidden_states indices it must read, what a reader that ignored the
# layout's offset would have read instead)
LAYOUTS = {
    "angelslim published (no ids, .bin)": (angelslim_published, (2, 4, 5), None),
    "vllm top-level ids": (vllm_top_level, (1, 4, 6), None),
    "sglang eagle_config ids": (sglang_eagle_config, (1, 4, 6), (0, 3, 5)),
    "angelslim trainer ids": (angelslim_trainer, (2, 4, 6), (1, 3, 5)),
    "speculators layers.0.*": (speculators, (1, 4, 6), None),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_captures_the_target_layers_it_names(tmp_path, target, layout):
    make, expected, naive = LAYOUTS[layout]
    head = load_feature_head(make(tmp_path / "head"), target.config, embed=target.get_input_embeddings())
    assert head.feature_layers == expected
    assert head.norm_before_residual is (layout == "speculators layers.0.*")
    fast = FastModel(target, max_len=64)
    FeatureDrafter(head, fast)  # the drafter sets what the target's passes capture
    ids = torch.randint(3, VOCAB, (18,), generator=torch.Generator().manual_seed(1))
    fast.forward(ids[:12], 0, 1)
    fast.forward(ids[12:18], 12, 6)
    with torch.no_grad():
        hs = target(ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(fast.cache.features[:18], torch.cat([hs[i][0] for i in expected], dim=-1),
                               atol=5e-4, rtol=1e-3)
    if naive is not None:  # the offset matters: these are other states
        wrong = torch.cat([hs[i][0] for i in naive], dim=-1)
        assert (fast.cache.features[:18] - wrong).abs().max() > 0.1


def test_the_published_layout_drafts_target_ids_through_d2t(tmp_path, target):
    head = load_feature_head(angelslim_published(tmp_path / "head"), target.config, embed=target.get_input_embeddings())
    fast = FastModel(target, max_len=64)
    drafter = FeatureDrafter(head, fast)
    ids = torch.zeros(32, dtype=torch.long)
    ids[:10] = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(2))
    fast.forward(ids[:9], 0, 1)  # the target has run every committed position but the last
    proposal = drafter.propose(ids, 10, 4, SamplingParams(), Sampler(seed=0))
    hot = set(torch.nonzero(head.t2d).flatten().tolist())  # the 40 target ids the head can propose
    assert len(proposal.tokens) == 4 and set(proposal.tokens.tolist()) <= hot


def test_a_head_for_another_qwen3_size_is_a_one_line_refusal(tmp_path, target):
    # AngelSlim's 8B head on a 4B-sized target: the hidden sizes differ
    folder = write(tmp_path / "head", ANGELSLIM | {"hidden_size": 80}, head_tensors(ANGELSLIM))
    with pytest.raises(ViasdError, match="hidden size 80 does not match the target's 64") as err:
        load_feature_head(folder, target.config, embed=target.get_input_embeddings())
    assert "\n" not in str(err.value)
