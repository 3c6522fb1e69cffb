"""The EAGLE-3 head's calls, decided once, as FastModel's layers' are (layer_calls.py).

The head runs in three ways: eager drafting passes (catch-up over several positions, and the
1-token step where it is not compiled), traced ones (its compiled drafting step and tree levels:
torch.compile sees PyTorch's operators only) and training (autograd: PyTorch's operators too).
`bind(head, traced)` makes one `HeadCalls` for each: eager, a packed product's bound kernel
(PackedLinear.bind) or a float product over the head's short-pass products (short_products, what the
layer takes decided now) and the RMSNorms' one-call kernel where it computes what the module does
(norms.norm_calls); traced, PyTorch's operators. `EagleHead` binds both when it allocates and again
after anything that replaces a weight (packing, a cast or a move), and each of its methods takes
the set it runs with, so no call asks whether it is traced or needs a gradient, or tests a device
or a dtype. tests/training/test_eagle_head.py compares the sets.
"""

from __future__ import annotations

from dataclasses import dataclass

from viasd_core.runtime.layer_calls import Call, mlp_call, product
from viasd_core.runtime.norms import norm_calls


@dataclass(frozen=True, slots=True)
class HeadCalls:
    fc: Call  # the three target features [.., 3H] -> one [.., H]
    q: Call
    k: Call
    v: Call
    o: Call
    mlp: Call
    lm_head: Call
    input_norm: Call
    hidden_norm: Call
    post_norm: Call
    final_norm: Call


def bind(head, traced: bool) -> HeadCalls:
    """`head`'s calls for eager passes (`traced` False) or for traced passes and training (True).
    Float products read the head's `pass_rows` at the call, as FastModel's do."""
    layer = head.midlayer
    attn = layer.self_attn

    def norm(module) -> Call:
        calls = norm_calls(module)
        return calls.traced if traced else calls.eager

    def prod(module) -> Call:
        return product(module, head, traced)

    return HeadCalls(fc=prod(head.fc), q=prod(attn.q_proj), k=prod(attn.k_proj), v=prod(attn.v_proj),
                     o=prod(attn.o_proj), mlp=mlp_call(layer.mlp, head, traced), lm_head=prod(head.lm_head),
                     input_norm=norm(layer.input_layernorm), hidden_norm=norm(layer.hidden_norm),
                     post_norm=norm(layer.post_attention_layernorm), final_norm=norm(head.norm))
