"""eagle_data.teacher_pass against the plain reference: each sequence alone through the full
forward. Batched, right-padded, with the output layer run only from the last prompt position on, it
must give the same features and the same next-token distributions wherever the head is trained and
scored, and the same loss."""

import math

import pytest
import torch

from conftest import tiny_model
from viasd_core.training import eagle_data, eagle_init, eagle_train, eagle_ttt

LAYERS = (1, 2, 3)


def reference(target, tokens, prompt_len):
    """The full forward of one sequence: features and top-k log-probabilities at every position."""
    with torch.no_grad():
        res = target(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    feats = torch.cat([res.hidden_states[l] for l in LAYERS], dim=-1)[0].to(torch.bfloat16)
    top_logp, top_ids = torch.log_softmax(res.logits[0].float(), dim=-1).topk(eagle_data.TOPK, dim=-1)
    return eagle_data.FeatureRecord(torch.tensor(tokens), feats, top_ids, top_logp, prompt_len)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_pass_equals_each_sequence_alone_where_the_head_learns(family):
    target = tiny_model(family, n_layers=4, seed=3)
    g = torch.Generator().manual_seed(0)
    # prompts of different lengths in one batch (one all prompt but its last token), answers of different lengths
    shapes = [(5, 9), (12, 4), (3, 20), (8, 1), (15, 15)]
    seqs = [(torch.randint(3, 256, (p + a,), generator=g).tolist(), p, "c") for p, a in shapes]
    records = eagle_data.teacher_pass(target, seqs, LAYERS, batch_size=8)
    for rec, (tokens, prompt_len, _) in zip(records, seqs):
        ref = reference(target, tokens, prompt_len)
        torch.testing.assert_close(rec.features.float(), ref.features.float(), atol=2e-2, rtol=0)
        lo = prompt_len - 1
        assert torch.equal(rec.top_ids[lo:], ref.top_ids[lo:])
        torch.testing.assert_close(rec.top_logp[lo:], ref.top_logp[lo:], atol=1e-4, rtol=0)  # batched products round a little differently
        assert torch.equal(rec.labels, ref.labels)
        # before it nothing is computed: probability 0
        assert bool((rec.top_logp[:lo] == -math.inf).all()) and not bool(rec.top_ids[:lo].any())
    head = eagle_init.init_head(target, LAYERS, torch.arange(256))
    index = eagle_train.draft_index(head)
    refs = [reference(target, t, p) for t, p, _ in seqs]
    torch.testing.assert_close(eagle_ttt.ttt_loss(head, records, index, 3)[0],
                               eagle_ttt.ttt_loss(head, refs, index, 3)[0], atol=1e-4, rtol=1e-4)
