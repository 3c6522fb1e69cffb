"""The weight format as a value (viasd_core.runtime.weight_format), `auto` and its reason, and
int4 on CUDA by construction: the activation padded to the width torchao's tile layout packed.

The CUDA kernel cannot run here, so its shape contract is played by a plain-PyTorch stand-in
(`tinygemm_standin`): torchao's own CUDA packing (`Int4TilePackedTo4dTensor.from_hp`, with its
padding) runs on CPU with only the final bit-interleaving replaced, and the stand-in refuses an
activation narrower than the packed weight, as `_weight_int4pack_mm` does.
"""


import pytest
import torch

from viasd_core.runtime.weight_format import (AUTO, BITSANDBYTES, BNB_4BIT, BNB_8BIT, FLOAT, INT4, INT8, NAMES, NONE,
                                               TORCHAO, WeightFormat)
from viasd_core.errors import UsageError

from conftest import needs_torchao
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# ---------------------------------------------------------------------- the value
@pytest.mark.parametrize("text, fmt, backend, bits, packed", [
    ("none", NONE, FLOAT, None, False),
    ("int8", INT8, TORCHAO, 8, True),
    ("int4", INT4, TORCHAO, 4, True),
    ("8bit", BNB_8BIT, BITSANDBYTES, 8, False),
    ("4bit", BNB_4BIT, BITSANDBYTES, 4, False),
])
def test_parse_every_spelling(text, fmt, backend, bits, packed):
    got = WeightFormat.parse(text)
    assert got is fmt and got.name == str(got) == text
    assert (got.backend, got.bits, got.packed, got.quantized) == (backend, bits, packed, backend != FLOAT)
    assert WeightFormat.parse(f" {text.upper()} ") is fmt
    assert got.display and got.display != text


def test_a_bad_spelling_is_one_line_naming_the_choices():
    assert NAMES == ("none", "int8", "int4", "gguf", "8bit", "4bit")
    for bad in ("int3", "", "auto", "fp8"):
        with pytest.raises(UsageError) as e:
            WeightFormat.parse(bad)
        assert e.value.message == f"unknown quantization '{bad}': use none, int8, int4, gguf (torchao) or 8bit, 4bit (bitsandbytes)"
    with pytest.raises(UsageError, match=r"^unknown quantization 'x': use auto, none, int8"):
        WeightFormat.parse("x", also=(AUTO,))


def test_only_int4_asks_for_a_gpu_generation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert INT4.cuda_capability == (8, 0)
    for fmt in (NONE, INT8, BNB_8BIT, BNB_4BIT):
        fmt.check_device(CUDA)  # any GPU
    INT4.check_device(CPU)
    with pytest.raises(UsageError) as e:
        INT4.check_device(CUDA)
    assert "\n" not in e.value.message
    assert "compute capability 8.0 or newer" in e.value.message and "this one is 7.5" in e.value.message
    assert "use --quant int8 or --quant 4bit" in e.value.message


# ---------------------------------------------------------------------- resolved in one place, with its reason
# (auto's timing: tests/machine/test_format_choice.py)
def test_an_asked_format_resolves_with_its_reason():
    from viasd_core.loading.models import resolve_format

    assert resolve_format("8bit", "smollm2-135m", CPU, None) == (BNB_8BIT, "8bit: asked for")
    assert resolve_format("none", "smollm2-135m", CPU, None) == (NONE, "none: asked for")
    assert resolve_format(" INT4", "smollm2-135m", CUDA, None) == (INT4, "int4: asked for")
    assert resolve_format(INT8, "smollm2-135m", CPU, None) == (INT8, "int8: asked for")  # a value passes through
    with pytest.raises(UsageError, match=r"unknown quantization 'int3': use auto, none, int8, int4"):
        resolve_format("int3", "smollm2-135m", CPU, None)


def test_session_carries_the_value_and_its_reason(tiny_dirs, viasd_home):
    from viasd_core.session import build_session
    from viasd_core.loading.options import ModelOptions

    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), device="cpu", draft="none", quant="auto"), mode="ar")
    assert session.target.format is NONE and session.options.quant == "none"  # the spelling: the profiles' key
    assert session.target.format_reason.startswith("none: auto picks a low-bit format only for the embedded target")


@needs_torchao
def test_load_model_records_the_format(tiny_dirs):
    from viasd_core.loading.models import load_model

    loaded = load_model(str(tiny_dirs["target"]), device="cpu", quant="int8", with_tokenizer=False)
    assert loaded.format is INT8 and loaded.quant == "int8" and loaded.format_reason == "int8: asked for"


def test_int4_is_refused_before_loading_on_a_gpu_older_than_compute_capability_8(monkeypatch):
    """tinygemm's CUDA kernel needs bfloat16 tensor cores (compute capability 8.0); on an older GPU
    the activations would be float16. Refused when the format is chosen, before any weight is read."""
    import viasd_core.loading.models as models
    from viasd_core.runtime.weight_formats import activation_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert activation_dtype(INT8, None, CUDA) == torch.float16  # int8 runs there, in float16
    with pytest.raises(UsageError, match=r"int4 needs a GPU of compute capability 8.0 or newer .* use --quant int8"):
        activation_dtype(INT4, None, CUDA)
    monkeypatch.setattr(models, "resolve_device", lambda device: CUDA)
    with pytest.raises(UsageError, match="compute capability 8.0"):  # not "model not found": nothing was read
        models.load_model("no/such-model", device="cuda", quant="int4")


# ---------------------------------------------------------------------- int4 on CUDA: the padded layout
def tinygemm_unpack(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """The float64 weight [N, K] behind the stand-in packing: two 4-bit values a byte (the even
    column in the high nibble, as torchao hands them to the packer) and tinygemm's scale_and_zero
    [K / group, N, 2]: w = (q - 8) * scale + zero."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    q = torch.stack([qdata >> 4, qdata & 15], dim=-1).reshape(n, k).double()
    assert scale_and_zero.shape == (k // group, n, 2)
    scale, zero = (t.T.double().repeat_interleave(group, dim=1) for t in scale_and_zero.unbind(-1))  # [N, K]
    return (q - 8) * scale + zero


def tinygemm_standin(x: torch.Tensor, qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """`_weight_int4pack_mm`'s contract on CUDA in plain PyTorch: x [M, K] in bfloat16 with K the
    packed (padded) input width, else it fails; returns x @ W.T over the packed [N, K] weight (float64)."""
    assert x.dtype == torch.bfloat16, f"activation dtype {x.dtype}"
    assert x.shape[1] == qdata.shape[1] * 2, f"activation width {x.shape[1]} != packed width {qdata.shape[1] * 2}"
    return x.double() @ tinygemm_unpack(qdata, group, scale_and_zero).T


@pytest.fixture
def cuda_int4_layout(monkeypatch):
    """weight_formats packs int4 as on CUDA (torchao's tile-packed layout, its padding included) and
    calls the stand-in for the CUDA kernel."""
    import viasd_core.runtime.weight_formats as wf
    from torchao.quantization.quantize_.workflows import Int4TilePackedTo4dTensor

    from viasd_core.runtime import packed_torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", lambda q, inner_k_tiles: q)  # keep the bytes
    monkeypatch.setattr(wf, "_int4_layout", lambda device: Int4TilePackedTo4dTensor)
    monkeypatch.setattr(packed_torch, "_int4_mm", tinygemm_standin)


# (hidden, intermediate) of the catalog's models: the layers read one and write the other
WIDTHS = {"SmolLM2-135M": (576, 1536), "Qwen2.5-0.5B": (896, 4864), "Qwen2.5-7B": (3584, 18944), "Llama-3.1-8B": (4096, 14336)}
# (hidden, K/V heads x head dim) of the large catalog models: their attention projections, q/o (h, h) and k/v (h, kv)
ATTENTION = {"Qwen2.5-7B": (3584, 512), "Llama-3.1-8B": (4096, 1024)}
LAYERS = ([(name, n_in, n_out) for name, (h, i) in WIDTHS.items() for n_in, n_out in ((h, i), (i, h))]
          + [(name, h, n_out) for name, (h, kv) in ATTENTION.items() for n_out in (h, kv)])
ROWS = 60  # output rows of the large layers: the padding of the output depends only on its width mod 8


@needs_torchao
@pytest.mark.parametrize("model, n_in, n_out", LAYERS, ids=[f"{m}-{i}x{o}" for m, i, o in LAYERS])
def test_cuda_int4_pads_the_activation_to_the_packed_width(cuda_int4_layout, model, n_in, n_out):
    from torchao.utils import find_multiple

    from viasd_core.runtime.weight_formats import INT4_GROUP, PackedLinear, apply_weight_format, int4_packed_shape

    n_out = n_out if n_in * n_out <= 5_000_000 else ROWS  # the full large layers take seconds each to pack
    torch.manual_seed(n_in + n_out)
    holder = torch.nn.Sequential(torch.nn.Linear(n_in, n_out, bias=False).to(torch.bfloat16))
    w = holder[0].weight.detach().double()
    apply_weight_format(holder, INT4)
    packed = holder[0]
    assert isinstance(packed, PackedLinear) and packed.kind == "int4"
    # torchao's rule, the shape it packed, and what PackedLinear read from it agree
    n_pad, k_pad = find_multiple(n_out, 8), find_multiple(n_in, 1024)
    assert int4_packed_shape(n_out, n_in, CUDA) == (n_pad, k_pad) and int4_packed_shape(n_out, n_in, CPU) == (n_out, n_in)
    assert packed.scale.shape == (k_pad // INT4_GROUP, n_pad, 2) and packed.qdata.shape == (n_pad, k_pad // 2)
    assert packed.packed_in == k_pad
    x = torch.randn(2, 3, n_in, dtype=torch.bfloat16)
    if k_pad != n_in:  # the unpadded activation (what PackedLinear passed before) breaks the kernel's contract
        with pytest.raises(AssertionError, match="activation width"):
            tinygemm_standin(x.reshape(-1, n_in), packed.qdata, INT4_GROUP, packed.scale)
    y = packed(x)
    assert y.shape == (2, 3, n_out)
    weight = tinygemm_unpack(packed.qdata, INT4_GROUP, packed.scale)[:n_out, :n_in]  # the layer's part of the packing
    torch.testing.assert_close(y.reshape(-1, n_out), x.reshape(-1, n_in).double() @ weight.T, rtol=1e-10, atol=1e-10)
    # ... and that part is the layer's own weight, within half a quantization step of its group of 32 (bf16
    # scale and zero aside): a column or row shifted by the padding breaks this bound
    g = w.reshape(n_out, -1, INT4_GROUP)
    step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).reshape(n_out, n_in)
    assert ((weight - w).abs() <= 0.65 * step + 2**-8 * w.abs()).all()


@needs_torchao
def test_cuda_int4_output_padding_is_sliced_off_and_bias_applied(cuda_int4_layout):
    from viasd_core.runtime.weight_formats import INT4_GROUP, apply_weight_format

    torch.manual_seed(7)
    layer = torch.nn.Linear(576, 100, bias=True).to(torch.bfloat16)  # 100 rows: packed as 104
    holder = torch.nn.Sequential(layer)
    apply_weight_format(holder, INT4)
    packed = holder[0]
    assert packed.scale.shape[1] == 104 and packed.packed_in == 1024
    x = torch.randn(5, 576, dtype=torch.bfloat16)
    weight = tinygemm_unpack(packed.qdata, INT4_GROUP, packed.scale)[:100, :576]
    ref = x.double() @ weight.T + layer.bias.detach().double()
    torch.testing.assert_close(packed(x), ref, rtol=1e-10, atol=1e-10)


@needs_torchao
def test_cpu_int4_is_packed_unpadded():
    from viasd_core.runtime.weight_formats import INT4_GROUP, apply_weight_format

    holder = torch.nn.Sequential(torch.nn.Linear(576, 96, bias=False).to(torch.bfloat16))
    apply_weight_format(holder, INT4)
    assert holder[0].packed_in == 576 == holder[0].scale.shape[0] * INT4_GROUP and holder[0].scale.shape[1] == 96
    assert holder[0](torch.randn(2, 576, dtype=torch.bfloat16)).shape == (2, 96)


@needs_torchao
def test_slim_views_offer_only_the_formats_the_gpu_runs(monkeypatch):
    from viasd_core.runtime.slim_view import lower_formats

    capability = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert lower_formats(NONE, CUDA) == ("int8", "int4") and lower_formats(INT8, CUDA) == ("int4",)
    capability[0] = (7, 5)
    assert lower_formats(NONE, CUDA) == ("int8",) and lower_formats(INT8, CUDA) == ()
    assert lower_formats(NONE, CPU) == lower_formats(NONE) == ("int8", "int4")
    assert not INT4.runs_on(CUDA) and INT4.runs_on(CPU) and INT8.runs_on(CUDA)
