"""--quant int8 / int4: weight-only formats packed by torchao (viasd_core.runtime.weight_formats).

The packed layer against a reference written here from the formats' definitions, the memory it
saves, the slim view sharing the target's packed layers, batch invariance, and greedy `sd` /
`exact` token-identical to `ar` at the same format: tiny models of every family (eager), a
compiled tiny model, the real SmolLM2 with its EAGLE-3 head. One-line refusals.
"""

import importlib.util

import pytest
import torch

from conftest import FAMILIES, tiny_model
from support.format_cases import engine, greedy_modes_equal_ar, quantized
from viasd_core.errors import UsageError, ViasdError
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.weight_formats import INT4_GROUP, PackedLinear, apply_weight_format, weight_bytes

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
FORMATS = ("int8", "int4")


def reference_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The weight each format represents, computed in float64 from its definition."""
    w = w.double()
    if fmt == "int8":  # symmetric, one scale per output row
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        return (w / scale).round().clamp(-128, 127) * scale
    g = w.reshape(w.shape[0], -1, INT4_GROUP)  # asymmetric, groups of 32 along the input (tinygemm)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-6) / 15
    q = ((g - lo) / scale).round().clamp(0, 15)
    return (q * scale + lo).reshape(w.shape)


def pack_one(fmt, n_in=128, n_out=96, seed=0, pays: bool | None = None):
    """One bfloat16 layer packed in `fmt`, and its weight; `pays`: the machine's bfloat16 verdict
    (machine/bf16.py) as a loader records it on the model, which the packed layer takes."""
    from viasd_core.runtime.weight_formats import BF16_PAYS

    torch.manual_seed(seed)
    linear = torch.nn.Linear(n_in, n_out, bias=False).to(torch.bfloat16)
    holder = torch.nn.Sequential(linear)
    if pays is not None:
        setattr(holder, BF16_PAYS, pays)
    w = linear.weight.detach().float()
    apply_weight_format(holder, WeightFormat.parse(fmt))
    assert isinstance(holder[0], PackedLinear) and holder[0].kind == fmt
    assert holder[0].bf16_pays is (True if pays is None else pays)
    return holder[0], w


def test_int8_packs_symmetric_rows_and_the_kernel_applies_them():
    packed, w = pack_one("int8")
    scale = w.double().abs().amax(dim=1) / 127
    assert torch.allclose(packed.scale.double(), scale, rtol=2**-8)  # one bf16 scale per output row
    q = (w.double() / packed.scale.double()[:, None]).round().clamp(-128, 127)
    assert (packed.qdata.double() == q).float().mean() > 0.99  # ties aside
    # Fed the identity, the kernel returns each weight it represents: q * scale, rounded once to bf16.
    probe = packed(torch.eye(128, dtype=torch.bfloat16))
    assert torch.equal(probe, (packed.qdata.float() * packed.scale.float()[:, None]).T.to(torch.bfloat16))
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.allclose(packed(x).float(), x.float() @ w.T, atol=0.05)  # and it is the layer, approximately


def check_dense_prefill_rows(monkeypatch, packed, name: str, weight: torch.Tensor, *args) -> list[int]:
    """Through `packed`: passes of up to 16 rows equal the kernel `name` (packed_torch) bit for
    bit; longer ones stay within twice the kernel's own error against `weight` [out, in] (plus bf16
    rounding). Returns the row counts the kernel ran (it is wrapped to count them)."""
    from viasd_core.runtime import packed_linear, packed_torch

    kernel_rows = []
    reference = getattr(packed_torch, name)
    monkeypatch.setattr(packed_torch, name, lambda x, *a: kernel_rows.append(x.shape[0]) or reference(x, *a))
    packed.bind(packed_kernel=False)  # PyTorch's kernels, the counted one (viasd_kernels' own: test_kernels_cpu_packed_mm)
    torch.manual_seed(3)
    for rows in (1, 6, 16, 17, 40, 256):
        x = torch.randn(rows, weight.shape[1], dtype=torch.bfloat16)
        got = packed(x)
        want = reference(x, *args)
        if rows < packed_linear.DENSE_PREFILL_ROWS:
            assert torch.equal(got, want), rows
        else:
            exact = x.double() @ weight.double().T
            assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-2, rows
    return kernel_rows


@pytest.mark.parametrize("pays", [True, False], ids=["bf16-products", "fp32-products"])
def test_cpu_int8_prefill_rows_take_one_dense_product_close_to_the_kernel(monkeypatch, pays):
    """Passes of up to 16 rows (decode, every verify block) run PyTorch's int8 kernel, bit for bit;
    longer ones (prefill chunks) widen the weight once and run one dense product, which rounds
    differently but stays within bf16 accumulation error of the kernel, in bfloat16 or (where
    bfloat16 products do not pay) in float32."""
    from viasd_core.runtime import packed_cpu

    assert packed_cpu.dense_dtype(torch.bfloat16, pays) == (torch.bfloat16 if pays else torch.float32)
    packed, _ = pack_one("int8", n_in=256, n_out=192, pays=pays)
    weight = packed.qdata.double() * packed.scale.double()[:, None]
    rows = check_dense_prefill_rows(monkeypatch, packed, "_int8_mm_reference", weight, packed.qdata, packed.scale)
    assert rows == [1, 6, 16]  # the layer ran the plain kernel only for the short passes


def test_int8_sd_and_exact_equal_ar_after_a_long_prompt():
    """A prompt longer than 16 tokens goes through the dense int8 prefill in every mode alike."""
    prompt = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ar = greedy_modes_equal_ar(engine(quantized("llama", "int8")), prompt)
    assert len(ar.tokens) == 40


@pytest.mark.parametrize("pays", [True, False], ids=["bf16-products", "fp32-products"])
def test_cpu_int4_prefill_rows_read_the_packed_layout_back_and_take_one_dense_product(monkeypatch, pays):
    """Passes of up to 16 rows run tinygemm's int4 kernel, bit for bit; longer ones (prefill chunks)
    unpack the weight once from PyTorch's CPU layout, which must be the weight the kernel applies,
    and run one dense product within bf16 accumulation error of the kernel (in bfloat16, or in
    float32 where bfloat16 products do not pay). A layout that does not read back (a partial last
    block of rows) keeps the kernel at every size."""
    from viasd_core.runtime import packed_cpu, packed_torch

    packed, _ = pack_one("int4", n_in=256, n_out=192, pays=pays)
    eye = torch.eye(256, dtype=torch.bfloat16)
    kernel_weight = packed_torch._int4_mm_cpu(eye, packed.qdata, packed.group, packed.scale).T  # [192, 256]
    dense = packed_cpu._int4_dense_cpu(packed.qdata, packed.group, packed.scale, torch.float32)
    assert dense is not None and torch.equal(dense.to(torch.bfloat16), kernel_weight)
    args = (packed.qdata, packed.group, packed.scale)
    assert check_dense_prefill_rows(monkeypatch, packed, "_int4_mm_cpu", kernel_weight, *args) == [1, 6, 16]
    kernel_rows = []
    reference = packed_torch._int4_mm_cpu
    monkeypatch.setattr(packed_torch, "_int4_mm_cpu", lambda x, *a: kernel_rows.append(x.shape[0]) or reference(x, *a))
    odd, _ = pack_one("int4", n_in=64, n_out=80)  # 80 rows: a partial block of 64
    assert packed_cpu._int4_dense_cpu(odd.qdata, odd.group, odd.scale, torch.bfloat16) is None
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    assert torch.equal(odd(x), reference(x, odd.qdata, odd.group, odd.scale)) and kernel_rows == [40]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_without_fast_bf16_products_the_prefill_multiplies_the_same_weights_in_float32(monkeypatch, fmt):
    """The float32 dense product holds the weight the kernel applies (its bfloat16 values, widened)
    and rounds only its output to bfloat16; held so for a whole prefill by widen_once."""
    from viasd_core.runtime import packed_cpu, packed_linear

    packed, _ = pack_one(fmt, n_in=256, n_out=192, pays=False)
    bf16 = packed.widened(torch.bfloat16)
    fp32 = packed.widened(packed_cpu.dense_dtype(torch.bfloat16, packed.bf16_pays))
    assert fp32.dtype == torch.float32 and torch.equal(fp32, bf16.float())
    x = torch.randn(40, 256, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), bf16.float()).to(torch.bfloat16)
    # the dense product: a prefill's where the short product does not run its chunks (the AVX2
    # class's int8-activation products do: Bound.chunks, and widen_once then holds nothing), and
    # every traced pass's
    chunked = packed._short is not None and packed._short.chunks
    with packed_linear.widen_once([packed], torch.bfloat16):
        assert packed.held is None if chunked else packed.held.dtype == torch.float32
        assert torch.equal(packed._operators(x), want)
    assert packed.held is None and torch.equal(packed._operators(x), want)  # widened for the call alone
    if not chunked:
        assert torch.equal(packed(x), want)


def test_int4_sd_and_exact_equal_ar_after_a_long_prompt():
    """A prompt longer than 16 tokens goes through the dense int4 prefill in every mode alike."""
    prompt = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ar = greedy_modes_equal_ar(engine(quantized("llama", "int4")), prompt)
    assert len(ar.tokens) == 40


def test_int4_kernel_computes_the_formats_weight():
    # Groups of 32 inputs at very different scales: a grouping other than 32 along the input
    # would round the small groups with the large groups' step.
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        layer.weight.mul_(torch.tensor([1.0, 20.0, 0.05, 3.0]).repeat_interleave(32))
    holder = torch.nn.Sequential(layer.to(torch.bfloat16))
    w = layer.weight.detach().float()
    apply_weight_format(holder, WeightFormat.parse("int4"))
    packed = holder[0]
    assert isinstance(packed, PackedLinear) and packed.kind == "int4"
    probe = packed(torch.eye(128, dtype=torch.bfloat16)).T.double()  # the weight the kernel applies
    w = w.double()
    ref = reference_weight(w, "int4")
    g = w.reshape(96, -1, INT4_GROUP)
    step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).reshape(96, 128)
    # Within about half a quantization step of its group (tinygemm keeps scale and zero in bf16,
    # which moves a level by up to ~0.15 step): a group other than 32, a transposed or mis-packed
    # weight breaks this bound.
    assert ((probe - w).abs() <= 0.65 * step + 2**-8 * w.abs()).all()
    assert (probe != w).float().mean() > 0.5  # and it really is quantized
    assert ((probe - ref).abs() < 0.2 * step).float().mean() > 0.95  # the levels of the definition (ties aside)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    assert packed(x[:1]).shape == (1, 96) and packed(x[None]).shape == (1, 5, 96)


@pytest.mark.parametrize("fmt, low, high", [("int8", 0.25, 0.30), ("int4", 0.15, 0.17)])
def test_layers_take_the_expected_fraction_of_fp32_memory(fmt, low, high):
    def layer_bytes(model):
        return weight_bytes(model.model.layers)

    full = tiny_model("llama", seed=5)
    q = quantized("llama", fmt)
    # int8: 1 byte + a bf16 scale per row; int4: half a byte + bf16 scale and zero per group of 32.
    ratio = layer_bytes(q) / layer_bytes(full)
    assert low < ratio < high, ratio
    assert not any(isinstance(m, torch.nn.Linear) for m in q.model.layers.modules())


def test_int4_keeps_the_output_head_in_int8_and_unties_it():
    model = tiny_model("llama", seed=5, tie_word_embeddings=True).to(torch.bfloat16)
    embed = model.get_input_embeddings().weight.detach().clone()
    apply_weight_format(model, WeightFormat.parse("int4"))
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.kind == "int8"
    assert model.model.layers[0].self_attn.q_proj.kind == "int4"
    assert torch.equal(model.get_input_embeddings().weight, embed)  # the lookup table is untouched


@pytest.mark.parametrize("fmt", FORMATS)
def test_slim_view_shares_the_targets_packed_layers(fmt):
    model = quantized("llama", fmt)
    target = FastModel(model, max_len=64)
    slim = FastModel(model, layer_ids=[0, 2], max_len=64, name="slim")
    assert slim.layers[1] is target.layers[2]
    assert slim.layers[1].self_attn.q_proj.qdata.data_ptr() == target.layers[2].self_attn.q_proj.qdata.data_ptr()
    assert target.weight_format and target.dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", FORMATS)
def test_eager_pass_is_batch_invariant(fmt):
    """A token's logits do not depend on how many tokens share its pass (what makes sd == ar):
    1-token passes equal verify blocks of every width, odd ones included, back to back as in sd."""
    fm = FastModel(quantized("qwen2", fmt), max_len=64)
    assert fm.min_pass == 1 and fm.row_attention
    ids = torch.randint(3, 200, (32,), generator=torch.Generator().manual_seed(1))
    fm.forward(ids[:16], 0, 1)
    one = torch.cat([fm.forward(ids[16 + i : 17 + i], 16 + i, 1) for i in range(14)])
    blocks = []
    fm.rollback(16)
    for width in (3, 5, 1, 2, 3):
        blocks.append(fm.forward(ids[fm.seen : fm.seen + width], fm.seen, width))
    assert torch.equal(torch.cat(blocks), one)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_sd_and_exact_equal_ar_at_the_same_format(family, fmt):
    model = quantized(family, fmt)
    ar = greedy_modes_equal_ar(engine(model), [5, 17, 33, 11, 64, 80])
    assert len(ar.tokens) == 40


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_int_formats_stay_eager_and_exact(fmt):
    """inductor's CPU graphs of a bf16 int8/int4 model round a position differently with the
    pass's width, so those models are not compiled on CPU (the eager pass is exact, and as fast)."""
    eng = engine(quantized("llama", fmt))
    assert not eng.compile() and not eng.target.compiled
    assert eng.warm_up() == 0.0
    greedy_modes_equal_ar(eng, [5, 17, 33, 11, 64, 80])


def test_load_model_applies_the_format_and_refuses_other_activation_dtypes(tiny_dirs):
    from viasd_core.loading.models import load_model

    folder = str(tiny_dirs["target"])
    loaded = load_model(folder, device="cpu", quant="int4", with_tokenizer=False)
    assert loaded.quant == "int4" and FastModel(loaded.model, max_len=32).weight_format
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(UsageError, match="bfloat16 activations: drop --dtype float32"):
        load_model(folder, device="cpu", quant="int8", dtype="float32", with_tokenizer=False)
    with pytest.raises(UsageError, match="unknown quantization 'int3'"):
        load_model(folder, device="cpu", quant="int3", with_tokenizer=False)


def test_missing_torchao_is_a_one_line_error(monkeypatch):
    import viasd_core.runtime.weight_formats as wf

    real = importlib.util.find_spec
    monkeypatch.setattr(wf.importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ViasdError, match=r"need torchao: pip install 'viasd\[quant\]'"):
        apply_weight_format(torch.nn.Sequential(torch.nn.Linear(32, 8)), WeightFormat.parse("int8"))


def test_cli_generate_with_int4_is_exact_and_says_so(tiny_dirs, viasd_home):
    from typer.testing import CliRunner

    from viasd_cli.app import get_app

    runner = CliRunner()
    base = ["generate", "hello world", "--model", str(tiny_dirs["target"]), "--device", "cpu", "-n", "24", "--quant", "int4"]
    ar = runner.invoke(get_app(), base + ["--mode", "ar", "--draft", "ngram"])
    sd = runner.invoke(get_app(), base + ["--mode", "sd", "--draft", "ngram"])
    assert ar.exit_code == 0 and sd.exit_code == 0, (ar.output, sd.output)
    assert ar.stdout == sd.stdout and ar.stdout.strip()
    bad = runner.invoke(get_app(), base + ["--mode", "ar", "--dtype", "float16"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    assert "drop --dtype float16" in bad.output


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_packed_layer_traces_into_one_graph_with_its_eager_numbers(monkeypatch, kind):
    """PackedLinear.forward reads its buffers from the module's dictionaries (a hot-path saving); the
    compiled passes (CUDA graphs on a GPU) trace it whole: fullgraph compile here, bit for bit eager.
    A traced CPU pass takes PyTorch's kernels (viasd_kernels' CPU products are C calls; the engine
    never compiles a packed CPU model: FastModel.compile), so eager is compared with those."""
    layer = torch.nn.Linear(64, 128, bias=kind == "int8").to(torch.bfloat16)
    from viasd_core.runtime import weight_formats as wf

    packed = wf._pack(layer, kind, packed_kernel=False)
    compiled = torch.compile(lambda x: packed(x), fullgraph=True)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(compiled(x), packed(x))
