"""Checks that the Python side of the C library matches its C side, instead of trusting it.

Three things cross the boundary and each is checked when the library is loaded:

* function signatures: the ctypes ``argtypes`` / ``restype`` the bindings declare are compared,
  argument by argument, with the ``PN_EXPORT`` prototypes parsed from ``csrc/pagedllm_native.h``
  (by kind: pointer, 32/64-bit integer, float);
* constants: read from the library by name (``pn_constant``), never retyped in Python;
* structs: every ctypes mirror's size, field count and each field's offset and size are compared
  with the compiler's ``sizeof`` / ``offsetof`` (``pn_struct_layout`` / ``pn_field_layout``).

Any difference raises :class:`NativeLibraryError` naming the function, argument or field.
"""
from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping, Sequence

HEADER_NAME = "pagedllm_native.h"

_C_SCALARS = {"void": "void", "int": "i32", "int32_t": "i32", "int64_t": "i64", "float": "f32", "double": "f64"}
_PROTOTYPE = re.compile(r"PN_EXPORT\s+(?P<ret>[\w\s*]+?)\s*\b(?P<name>\w+)\s*\((?P<args>[^)]*)\)\s*;")

# name -> (return kind, ((argument name, kind), ...))
Prototypes = dict[str, tuple[str, tuple[tuple[str, str], ...]]]
# name -> (ctypes restype, ctypes argtypes)
Signatures = Mapping[str, tuple[type | None, Sequence[type]]]


class NativeLibraryError(RuntimeError):
    """The C library cannot be built or loaded, or does not match its Python bindings."""


def _strip(header: str) -> str:
    """The header without comments and preprocessor lines (``#define PN_EXPORT`` included)."""
    header = re.sub(r"/\*.*?\*/", " ", header, flags=re.S)
    header = re.sub(r"//[^\n]*", " ", header)
    return re.sub(r"^\s*#.*$", " ", header, flags=re.M)


def c_kind(c_type: str, where: str) -> str:
    """``"ptr"`` for any pointer, else the scalar's kind (``"i32"``, ``"i64"``, ``"f32"``...)."""
    if "*" in c_type:
        return "ptr"
    base = " ".join(w for w in c_type.split() if w != "const")
    if base not in _C_SCALARS:
        raise NativeLibraryError(f"{HEADER_NAME}: {where} has C type {c_type!r}, which the check cannot map")
    return _C_SCALARS[base]


def ctypes_kind(t: type | None) -> str:
    """The same kinds for a ctypes type (``None`` is a void return)."""
    if t is None:
        return "void"
    if t in (ctypes.c_void_p, ctypes.c_char_p) or hasattr(t, "contents"):  # POINTER(x) types have .contents
        return "ptr"
    prefix = "f" if t in (ctypes.c_float, ctypes.c_double) else "i"
    return f"{prefix}{8 * ctypes.sizeof(t)}"


def _parse_arg(arg: str, where: str) -> tuple[str, str]:
    name = re.findall(r"\w+", arg)[-1]
    return name, c_kind(arg[: arg.rindex(name)], f"{where} argument {name!r}")


def parse_prototypes(header: str) -> Prototypes:
    """Every ``PN_EXPORT`` function of the header text, with the kinds of its return and arguments."""
    out: Prototypes = {}
    for m in _PROTOTYPE.finditer(_strip(header)):
        name = m["name"]
        args = [a.strip() for a in m["args"].split(",")]
        args = [] if args == ["void"] else args
        out[name] = (c_kind(m["ret"], f"{name} return"), tuple(_parse_arg(a, name) for a in args))
    return out


def check_signatures(signatures: Signatures, header: str) -> None:
    """Raises unless the declared ctypes signatures are exactly the header's exported prototypes."""
    protos = parse_prototypes(header)
    if set(protos) != set(signatures):
        missing, extra = sorted(set(protos) - set(signatures)), sorted(set(signatures) - set(protos))
        raise NativeLibraryError(f"{HEADER_NAME} exports {missing} without bindings; bindings for {extra} "
                                 "have no PN_EXPORT prototype")
    for name, (restype, argtypes) in signatures.items():
        ret, args = protos[name]
        if ctypes_kind(restype) != ret:
            raise NativeLibraryError(f"{name}: returns {ret} in {HEADER_NAME}, the bindings declare {restype}")
        if len(argtypes) != len(args):
            raise NativeLibraryError(f"{name}: {len(args)} arguments in {HEADER_NAME}, the bindings declare "
                                     f"{len(argtypes)}")
        for i, ((arg, kind), t) in enumerate(zip(args, argtypes)):
            if ctypes_kind(t) != kind:
                raise NativeLibraryError(f"{name}: argument {i} ({arg}) is {kind} in {HEADER_NAME}, the "
                                         f"bindings declare {t.__name__}")


def header_constant(header: str, name: str) -> int:
    """The integer value of ``#define name value`` in the header text."""
    m = re.search(rf"^\s*#define\s+{name}\s+(-?\d+)\b", header, flags=re.M)
    if m is None:
        raise NativeLibraryError(f"{HEADER_NAME} has no '#define {name} <integer>'")
    return int(m[1])


def read_constant(lib: ctypes.CDLL, name: str) -> int:
    """A constant the library exports by name (``pn_constant``)."""
    value = ctypes.c_int64()
    if lib.pn_constant(name.encode(), ctypes.byref(value)) != 0:
        raise NativeLibraryError(f"the library exports no constant {name!r} (native.c CONSTANTS)")
    return value.value


def check_struct(lib: ctypes.CDLL, mirror: type[ctypes.Structure]) -> None:
    """Raises unless the ctypes ``mirror`` (named like its C typedef) has the C struct's layout."""
    name = mirror.__name__
    size, num_fields = ctypes.c_int64(), ctypes.c_int64()
    if lib.pn_struct_layout(name.encode(), ctypes.byref(size), ctypes.byref(num_fields)) != 0:
        raise NativeLibraryError(f"the library describes no struct {name!r} (native.c STRUCTS)")
    for field, _ in mirror._fields_:
        _check_field(lib, mirror, field)
    got = (ctypes.sizeof(mirror), len(mirror._fields_))
    if got != (size.value, num_fields.value):
        raise NativeLibraryError(f"{name}: the ctypes mirror has size {got[0]} and {got[1]} fields, the C struct "
                                 f"{size.value} and {num_fields.value}: make the mirror follow {HEADER_NAME}")


def _check_field(lib: ctypes.CDLL, mirror: type[ctypes.Structure], field: str) -> None:
    name, offset, size = mirror.__name__, ctypes.c_int64(), ctypes.c_int64()
    if lib.pn_field_layout(name.encode(), field.encode(), ctypes.byref(offset), ctypes.byref(size)) != 0:
        raise NativeLibraryError(f"{name}.{field}: the C struct has no such field (or native.c FIELDS misses it)")
    descr = getattr(mirror, field)
    if (descr.offset, descr.size) != (offset.value, size.value):
        raise NativeLibraryError(f"{name}.{field}: the ctypes mirror has offset {descr.offset} size {descr.size}, "
                                 f"the C struct offset {offset.value} size {size.value}: make the mirror follow "
                                 f"the field order and types of {HEADER_NAME}")
