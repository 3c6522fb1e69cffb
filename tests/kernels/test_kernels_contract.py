"""The contract between viasd_kernels' C functions and their Python callers.

One header (kernels/viasd_kernels.h) declares every exported function: the compiler checks each
definition against it, the ctypes types are read from it (and agree with what the compiler reads in
it), the structs cpu_layer.py hands to C are laid out as the compiler lays them out. And the Python
wrappers refuse, with one line, what would make the C code read or write the wrong memory (a dtype,
a layout, a shape, a device, an int32 `pos`, an `end` outside the cache), and bind again where a
bound tensor's storage was replaced (`.data =`) instead of reading the freed one.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from support.int4_cases import case, pack
from viasd_kernels import (cpu_build, cpu_f32_mm as fm, cpu_flags, cpu_header, cpu_int4_widen as cw, cpu_layer,
                           cpu_packed_mm as pm, cpu_rms_norm as rn, cpu_rope_write as rw, cpu_row_attention as ra)

KERNELS = Path(cpu_build.__file__).parent
HEADER = KERNELS / cpu_header.HEADER
bf = torch.bfloat16


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if cpu_flags.compiler() is None:
        assert not os.environ.get("CI"), "CI needs a C compiler for the CPU kernels"
        pytest.skip("no C compiler here")
    return tmp_path_factory.mktemp("kernels")


# --- one header ----------------------------------------------------------------------------------

def test_every_exported_function_has_a_prototype(build_dir):
    nm = shutil.which("nm")
    if nm is None:
        assert not os.environ.get("CI"), "CI has binutils"
        pytest.skip("no nm here to list a library's symbols")
    protos = cpu_header.prototypes()
    seen = set()
    for source in sorted(KERNELS.glob("cpu_*.c")):
        lib = cpu_build.build(source, build_dir)
        assert lib is not None, cpu_build.why_not(source)
        (path,) = build_dir.glob(f"{source.stem}-*.so")
        out = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
        exported = {line.split()[-1] for line in out.splitlines() if " T " in line}
        assert exported and exported <= set(protos), (source.name, exported - set(protos))
        seen |= exported
    assert seen == set(protos), set(protos) - seen  # no prototype without a definition


def test_the_python_types_are_the_ones_the_compiler_reads_in_the_header(tmp_path):
    """gcc's -aux-info writes every prototype as it parsed it: the same types, in the same order, as
    cpu_build's reading of the header."""
    cc = cpu_flags.compiler()
    if cc is None or "gcc" not in cpu_flags.compiler_version(cc).lower() and "free software" not in cpu_flags.compiler_version(cc).lower():
        assert not os.environ.get("CI"), "CI builds with gcc"
        pytest.skip("the compiler is not gcc (-aux-info is gcc's)")
    src = tmp_path / "all.c"
    src.write_text(f'#include "{HEADER}"\n')
    aux = tmp_path / "aux.txt"
    done = subprocess.run([cc, "-std=gnu11", "-c", str(src), "-o", str(tmp_path / "all.o"), "-aux-info", str(aux)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [line for line in aux.read_text().splitlines() if cpu_header.HEADER in line]
    header = tmp_path / "as_read.h"
    header.write_text("\n".join(re.sub(r"^/\*.*?\*/\s*extern\s+", "", line) for line in lines) + "\n")
    as_read = cpu_header.prototypes(header)
    assert as_read == cpu_header.prototypes() and len(as_read) >= 9


def test_each_wrapper_calls_its_function_with_the_headers_types(build_dir):
    protos = cpu_header.prototypes()
    for fn, name in ((rn._function(build_dir), "viasd_rms_norm"), (rw._function(build_dir), "viasd_rope_write"),
                     (ra._function(build_dir), "viasd_row_attention"), (cw._function(build_dir), "viasd_int4_widen"),
                     (cpu_layer._function(build_dir), "viasd_layer_front")):
        assert fn is not None and (fn.restype, fn.argtypes) == (protos[name][0], protos[name][1]), name
    assert protos["viasd_rope_write"][1][8] is ctypes.c_void_p and protos["viasd_rope_write"][1][16] is ctypes.c_int64


def test_argtypes_a_caller_still_passes_must_be_the_headers(build_dir):
    with pytest.raises(ValueError, match="disagree with viasd_kernels.h"):
        cpu_build.function(rn.SOURCE, build_dir / "other", "viasd_rms_norm", [ctypes.c_void_p] * 7)
    assert cpu_build.function(rn.SOURCE, build_dir, "viasd_no_such_kernel") is None
    assert rn.why_not() == "viasd_kernels.h has no prototype for viasd_no_such_kernel"


def test_a_definition_that_differs_from_its_prototype_does_not_build(tmp_path):
    if cpu_flags.compiler() is None:
        pytest.skip("no C compiler here")
    shutil.copy(HEADER, tmp_path / HEADER.name)
    shutil.copy(KERNELS / "cpu_bf16.h", tmp_path / "cpu_bf16.h")
    text = rn.SOURCE.read_text()
    wrong = tmp_path / "cpu_rms_norm.c"  # rows as int: an int64_t in the header
    wrong.write_text(text.replace("void *out, int64_t rows, int64_t H", "void *out, int rows, int64_t H"))
    assert cpu_build.build(wrong, tmp_path / "a") is None
    assert "conflicting types" in cpu_build.why_not(wrong)
    (tmp_path / "cpu_rms_norm.c").write_text(text + "\nint viasd_unlisted(void) { return 1; }\n")
    assert cpu_build.build(tmp_path / "cpu_rms_norm.c", tmp_path / "b") is None
    assert "viasd_unlisted" in cpu_build.why_not(tmp_path / "cpu_rms_norm.c")  # no previous prototype


def test_the_layer_structs_are_laid_out_as_the_compiler_lays_them_out(build_dir):
    layout = cpu_build.function(cpu_layer.SOURCE, build_dir, "viasd_layer_layout")
    out = (ctypes.c_int64 * 64)()
    n = layout(out, 64)
    ours = []
    for struct in (cpu_layer._Kernels, cpu_layer._Layer):
        ours += [ctypes.sizeof(struct)] + [getattr(struct, name).offset for name, _ in struct._fields_]
    assert list(out[:n]) == ours


# --- what the wrappers refuse ------------------------------------------------------------------------

def int4_bound(n, k, seed, build_dir):
    values, sz = case(n, k, 32, seed)
    return pm.bind_int4(pack(values, 64), 32, sz, 64, build_dir=build_dir)


@pytest.fixture
def front(build_dir):
    """A layer front over random int4 weights: hidden 64, 4 heads and 2 KV heads of 16, 40 slots."""
    if not pm.available(build_dir):
        assert not os.environ.get("CI"), f"the packed products must build in CI: {pm.why_not(build_dir)}"
        pytest.skip(f"the layer kernel needs the packed products: {pm.why_not(build_dir)}")
    g = torch.Generator().manual_seed(0)
    norms = [rn.bind(torch.nn.Parameter(torch.randn(64, generator=g).to(bf)), 1e-6, build_dir=build_dir)
             for _ in range(2)]
    kc, vc = torch.zeros(1, 2, 40, 16, dtype=bf), torch.zeros(1, 2, 40, 16, dtype=bf)
    parts = (*norms, int4_bound(128, 64, 1, build_dir), int4_bound(64, 64, 2, build_dir),
             int4_bound(128, 64, 3, build_dir), rw.bind(kc, vc, build_dir=build_dir))
    return cpu_layer.bind(*parts, 4, 0.25, None, build_dir=build_dir)


def front_args(T=3, end=13, seed=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, T, 64, generator=g).to(bf), torch.randn(T, 16, generator=g).to(bf),
            torch.randn(T, 16, generator=g).to(bf), torch.arange(end - T, end), end)


def test_the_layer_front_refuses_what_would_read_or_write_the_wrong_memory(front):
    x, cos, sin, pos, end = front_args()
    caches = [c.clone() for c in front.writer.caches]
    wrong = {
        "pos torch.int64": dict(pos=pos.int()),  # read as int64: slots 10 and 11 as one, in the wrong place
        "x torch.bfloat16": dict(x=x.float()),
        "x contiguous": dict(x=torch.randn(1, 64, 3).to(bf).transpose(1, 2)),
        "x [1, 1..16, 64]": dict(x=torch.randn(1, 17, 64).to(bf)),
        "cos [3, 16]": dict(cos=torch.randn(3, 32).to(bf)),
        "sin torch.bfloat16 on the CPU": dict(sin=sin.to("meta")),
        "pos [3]": dict(pos=torch.arange(10, 14)),
        "end in [3, 40]": dict(end=41),
        "end in [3, 40] (the pass's rows": dict(end=2),
        "step 3 refused": dict(pos=torch.tensor([38, 39, 40])),  # a slot past the cache: refused by the kernel
    }
    for says, change in wrong.items():
        args = dict(x=x, cos=cos, sin=sin, pos=pos, end=end) | change
        with pytest.raises(ValueError, match=re.escape(says)) as refused:
            front(args["x"], args["cos"], args["sin"], args["pos"], args["end"])
        assert "\n" not in str(refused.value)
        assert all(torch.equal(a, b) for a, b in zip(caches, front.writer.caches)), says  # nothing written
    front(x, cos, sin, pos, end)
    assert not torch.equal(caches[0], front.writer.caches[0])


def f32_front(build_dir, seed=0):
    """A float32 layer front: hidden 64, 4 heads and 2 KV heads of 16, an MLP of 96, 40 slots; and its parts."""
    g = torch.Generator().manual_seed(seed)
    norms = [rn.bind(torch.nn.Parameter(torch.randn(64, generator=g)), 1e-6, build_dir=build_dir) for _ in range(2)]
    products = [fm.bind(torch.randn(n, k, generator=g) / 8, build_dir=build_dir)
                for n, k in ((64, 64), (32, 64), (32, 64), (64, 64), (96, 64), (96, 64))]
    writer = rw.bind(torch.zeros(1, 2, 40, 16), torch.zeros(1, 2, 40, 16), build_dir=build_dir)
    return cpu_layer.bind_f32(*norms, *products, writer, 4, 0.25, None, build_dir=build_dir), (norms, products, writer)


def test_a_float32_layer_front_is_the_float32_calls_one_by_one_bit_for_bit(build_dir):
    """cpu_layer.bind_f32: the norms, the row-invariant products (q, k, v side by side; o with its
    residual; gate and up side by side), RoPE with the cache writes and row attention, in one call:
    the numbers of the same kernels called one by one, at every pass width, and the same cache."""
    front, (norms, (q, k, v, o, gate, up), writer) = f32_front(build_dir)
    assert front is not None and front.dtype == torch.float32
    _, (norms2, products2, writer2) = f32_front(build_dir)  # the same weights, a cache of its own
    q2, k2, v2, o2, gate2, up2 = products2
    for T, end in ((1, 9), (3, 13), (16, 40)):
        g = torch.Generator().manual_seed(T)
        x, cos, sin = torch.randn(1, T, 64, generator=g), torch.randn(T, 16, generator=g), torch.randn(T, 16, generator=g)
        pos = torch.arange(end - T, end)
        x2, gu = front(x, cos, sin, pos, end)
        h = norms2[0](x)
        rq = writer2(q2(h), k2(h), v2(h), cos, sin, pos)
        a = ra.row_attention(rq, *writer2.caches, end, None, 0.25, build_dir=build_dir)
        want_x2 = o2(a, x)
        h2 = norms2[1](want_x2)
        assert torch.equal(x2, want_x2), T
        assert torch.equal(gu, torch.cat([gate2(h2), up2(h2)], -1)), T
        assert all(torch.equal(a, b) for a, b in zip(writer.caches, writer2.caches)), T
    with pytest.raises(ValueError, match="x torch.float32"):  # the bfloat16 rows of an int4 layer: refused
        front(x.to(bf), cos, sin, pos, end)
    # a weight replaced in place: read, not the freed storage
    q.weight.data = torch.randn(64, 64) / 4
    before = x2
    x2, _ = front(x, cos, sin, pos, end)
    assert not torch.equal(x2, before)
    assert fm.bind(torch.zeros(64, 64), torch.zeros(64), build_dir=build_dir) is not None
    biased = fm.bind(torch.randn(64, 64), torch.zeros(64), build_dir=build_dir)  # a bias: the calls stay one by one
    assert cpu_layer.bind_f32(*norms, biased, k, v, o, gate, up, writer, 4, 0.25, None, build_dir=build_dir) is None
    assert cpu_layer.bind_f32(*norms, q, k, v, o, gate, fm.bind(torch.randn(80, 64), build_dir=build_dir), writer, 4,
                              0.25, None, build_dir=build_dir) is None  # gate and up of other widths


def test_the_packed_product_refuses_rows_it_would_misread(build_dir):
    if not pm.available(build_dir):
        pytest.skip(f"the packed products do not run here: {pm.why_not(build_dir)}")
    bound = int4_bound(64, 64, 5, build_dir)
    x = torch.randn(2, 64).to(bf)
    for bad in (x.float(), torch.randn(64, 2).to(bf).t(), x.to("meta"), x[:, :32]):
        with pytest.raises(ValueError, match="contiguous bfloat16 rows of 64 inputs on the CPU"):
            bound(bad)
    with pytest.raises(ValueError, match="residual must be"):
        bound(x, torch.zeros(2, 64).to(bf).to("meta"))


def test_row_attention_refuses_tensors_that_do_not_fit_together(build_dir):
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    with pytest.raises(ValueError, match="alike"):
        ra.row_attention(q, k, v[:, :, :10].contiguous(), 10, build_dir=build_dir)  # v shorter than k
    with pytest.raises(ValueError, match="alike"):
        ra.row_attention(q, k, torch.randn(1, 2, 20, 32), 10, build_dir=build_dir)
    with pytest.raises(ValueError, match=r"key_mask \(3, 8\)"):
        ra.row_attention(q, k, v, 10, key_mask=torch.ones(3, 8, dtype=torch.bool), build_dir=build_dir)
    with pytest.raises(ValueError, match=r"key_mask \(2, 10\)"):
        ra.row_attention(q, k, v, 10, key_mask=torch.ones(2, 10, dtype=torch.bool), build_dir=build_dir)
    with pytest.raises(ValueError, match="window -1"):
        ra.row_attention(q, k, v, 10, -1, build_dir=build_dir)


def test_rope_write_refuses_tensors_off_the_cpu(build_dir):
    kc = torch.zeros(1, 2, 20, 16)
    writer = rw.bind(kc, torch.zeros(1, 2, 20, 16), build_dir=build_dir)
    q, k, cos = torch.randn(1, 3, 64), torch.randn(1, 3, 32), torch.randn(3, 16)
    for bad in (dict(pos=torch.arange(3).to("meta")), dict(q=q.to("meta"))):
        args = dict(q=q, k=k, v=k, cos=cos, sin=cos, pos=torch.arange(3)) | bad
        with pytest.raises(ValueError, match="CPU tensors"):
            writer(*args.values())
    assert not kc.any()


# --- storage replaced under a bound kernel ----------------------------------------------------------

def test_a_norm_weight_replaced_in_place_is_read_not_the_freed_one(build_dir):
    w = torch.nn.Parameter(torch.randn(64))
    norm = rn.bind(w, 1e-6, build_dir=build_dir)
    x = torch.randn(3, 64)
    before = norm(x)
    w.data = torch.randn(64) * 3  # the old storage is freed
    assert torch.equal(norm(x), rn.bind(w, 1e-6, build_dir=build_dir)(x)) and not torch.equal(norm(x), before)
    w.data = torch.randn(48)
    with pytest.raises(ValueError, match="replaced by .48.*bind it again"):
        norm(x)


def test_a_packed_weight_replaced_in_place_is_read_not_the_freed_one(build_dir):
    if not pm.available(build_dir):
        pytest.skip(f"the packed products do not run here: {pm.why_not(build_dir)}")
    values, sz = case(64, 64, 32, seed=6)
    qdata = pack(values, 64)
    bound = pm.bind_int4(qdata, 32, sz, 64, build_dir=build_dir)
    x = torch.randn(2, 64).to(bf)
    before = bound(x)
    values2, sz2 = case(64, 64, 32, seed=7)
    qdata.data, sz.data = pack(values2, 64), sz2  # laid out again for the kernel at the next call
    fresh = pm.bind_int4(pack(values2, 64), 32, sz2, 64, build_dir=build_dir)
    assert torch.equal(bound(x), fresh(x)) and not torch.equal(bound(x), before)
    qdata.data = torch.zeros(64, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not take: bind it again"):
        bound(x)


def test_a_cache_replaced_in_place_takes_the_writes(build_dir):
    kc, vc = torch.zeros(1, 2, 20, 16), torch.zeros(1, 2, 20, 16)
    writer = rw.bind(kc, vc, build_dir=build_dir)
    q, k, cos = torch.randn(1, 1, 64), torch.randn(1, 1, 32), torch.randn(1, 16)
    kc.data, vc.data = torch.zeros(1, 2, 30, 16), torch.zeros(1, 2, 30, 16)
    writer(q, k, k, cos, cos, torch.tensor([25]))  # a slot only the new, longer cache has
    assert kc[0, :, 25].any() and vc[0, :, 25].any() and writer.s == 30


def test_a_layer_front_reads_a_weight_replaced_in_place(front, build_dir):
    x, cos, sin, pos, end = front_args()
    front.parts[0].weight.data = torch.randn(64).to(bf) * 2
    front.parts[2].weights[0].data = pack(case(128, 64, 32, seed=9)[0], 64)
    got = front(x, cos, sin, pos, end)
    norm_in = rn.bind(front.parts[0].weight.detach().clone(), 1e-6, build_dir=build_dir)
    qkv = pm.bind_int4(front.parts[2].weights[0].clone(), 32, front.parts[2].weights[1], 64, build_dir=build_dir)
    fresh = cpu_layer.bind(norm_in, *front.parts[1:2], qkv, *front.parts[3:], 4, 0.25, None, build_dir=build_dir)
    want = fresh(x, cos, sin, pos, end)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
