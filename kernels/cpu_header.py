"""The kernels' one interface: viasd_kernels.h holds the prototype of every exported function; every
C file includes it, and the build makes a global function without a prototype there, an implicit
declaration or a mismatched pointer an error. `prototypes` reads the ctypes argument and result types
from that header (a small parser of the few types the interface uses), `struct_fields` its structs,
so a signature is written once."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

HEADER = "viasd_kernels.h"
_VALUES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}
_QUALIFIERS = {"const", "volatile", "restrict", "struct", "signed"}
_parsed: dict[Path, tuple[dict, dict]] = {}


def _ctype(decl: str, header: Path):
    """(name, ctypes type) of one declaration: any pointer an address (c_void_p), else a value type."""
    decl = " ".join(decl.split())
    m = re.fullmatch(r"(?P<type>.*?)(?P<name>\w*)", decl)
    typ, name = m["type"].strip(), m["name"]
    if "*" in typ:
        return name, ctypes.c_void_p
    words = [w for w in typ.split() if w not in _QUALIFIERS]
    if not words and name in _VALUES:  # an unnamed argument: `int`
        words, name = [name], ""
    if len(words) != 1 or words[0] not in _VALUES:
        raise ValueError(f"{header.name}: a type the Python side cannot take: {decl!r} (int, int64_t, float, "
                         f"double or a pointer)")
    return name, _VALUES[words[0]]


def _parse(header: Path) -> tuple[dict, dict]:
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", header.read_text(), flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    functions, structs = {}, {}
    for m in re.finditer(r"struct\s+(\w+)\s*\{([^}]*)\}\s*;", text):
        structs[m[1]] = [_ctype(field, header) for field in m[2].split(";") if field.strip()]
    text = re.sub(r"struct\s+(\w+)\s*\{[^}]*\}\s*;", " ", text)
    for statement in text.split(";"):
        statement = " ".join(statement.split())
        if not statement or re.fullmatch(r"struct \w+", statement):
            continue
        m = re.fullmatch(r"(?P<ret>[\w\s*]+?)\s*\b(?P<name>\w+)\s*\((?P<args>[^()]*)\)", statement)
        if m is None:
            raise ValueError(f"{header.name}: not a prototype the Python side can read: {statement!r}")
        ret = None if m["ret"].split() == ["void"] else _ctype(m["ret"] + " x", header)[1]
        args = [] if m["args"].strip() in ("", "void") else [_ctype(a, header)[1] for a in m["args"].split(",")]
        functions[m["name"]] = (ret, args)
    return functions, structs


def read(header: Path) -> tuple[dict, dict]:
    """(functions, structs) `header` declares, read once a process."""
    if header not in _parsed:
        _parsed[header] = _parse(header)
    return _parsed[header]


def prototypes(header: Path | None = None) -> dict[str, tuple[object, list]]:
    """name -> (restype, argtypes) of every function viasd_kernels.h (or `header`) declares."""
    return read(Path(header) if header else Path(__file__).with_name(HEADER))[0]


def struct_fields(name: str, header: Path | None = None) -> list[tuple[str, object]]:
    """ctypes `_fields_` of `struct name` as viasd_kernels.h (or `header`) defines it."""
    return read(Path(header) if header else Path(__file__).with_name(HEADER))[1][name]
