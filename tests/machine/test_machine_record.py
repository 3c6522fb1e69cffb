"""machine/record.py's MachineRecord: the one cache of this machine's measurements that the auto choices share
(format, compilation, tree, short products): where a record lives, what it stores beside the
measurement, and what `load` makes of a missing, broken or foreign file."""

import json

import torch

from viasd_core.machine.record import MachineRecord, machine_identity

CPU = torch.device("cpu")


def test_a_record_round_trips_with_what_it_was_measured_on(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    record = MachineRecord("compile", CPU, {"model": "m", "context": 64}, version=3)
    assert not record.exists() and record.load() is None
    record.store({"on": True, "reason": "r"})
    data = record.load()
    assert data["on"] is True and data["reason"] == "r"
    assert data["version"] == 3 and data["model"] == "m" and data["context"] == 64
    assert data["machine"] == machine_identity(CPU) and data["threads"] == torch.get_num_threads()
    assert [p.name for p in record.path.parent.iterdir()] == [record.path.name]  # no temporary file left
    assert record.path.is_relative_to(tmp_path)


def test_the_key_version_kind_and_threads_each_name_another_file(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    base = MachineRecord("tree", CPU, {"model": "m"}, version=1)
    others = [MachineRecord("tree", CPU, {"model": "n"}, version=1), MachineRecord("tree", CPU, {"model": "m"}, version=2),
              MachineRecord("format", CPU, {"model": "m"}, version=1)]
    assert len({base.path, *(r.path for r in others)}) == 4
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert MachineRecord("tree", CPU, {"model": "m"}, version=1).path != base.path
    finally:
        torch.set_num_threads(threads)
    assert MachineRecord("tree", CPU, {"model": "m"}, version=1).path == base.path


def test_the_instruction_set_class_in_force_names_another_file(tmp_path, monkeypatch):
    """A measurement made at the CPU's own class (bfloat16 products pay with AVX-512 BF16) is not read
    under VIASD_MAX_CPU_ISA's lower class, which ATen's capability alone does not tell apart."""
    from viasd_kernels import instruction_set

    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    monkeypatch.setattr(instruction_set, "isa_class", lambda: "avx512_bf16")
    native = MachineRecord("bf16-products", CPU, {}, version=1).path
    monkeypatch.setattr(instruction_set, "isa_class", lambda: "avx512")
    assert MachineRecord("bf16-products", CPU, {}, version=1).path != native
    assert machine_identity(CPU)["isa_class"] == "avx512"


def test_a_broken_or_foreign_file_loads_as_none_and_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    record = MachineRecord("format", CPU, {"model": "m"}, version=1)
    record.path.parent.mkdir(parents=True)
    for blob in (b"{not json", b"[1, 2]", b"\xff\xfe\x00"):  # broken, not an object, not UTF-8
        record.path.write_bytes(blob)
        assert record.exists() and record.load() is None
    record.store({"format": "int4"})
    assert json.loads(record.path.read_text())["format"] == "int4"
    record.forget()
    assert not record.exists() and record.load() is None
    record.forget()  # forgetting nothing is fine
