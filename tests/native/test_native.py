"""The C library's Python side is checked against its C side: signatures, constants, structs."""
from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from pagedllm.native import abi, bindings, build
from pagedllm.native.bindings import LdBatch, LdModel, NativeLibrary, NativeLibraryError

pytestmark = pytest.mark.skipif(not bindings.is_available(), reason="no C compiler")

HEADER_TEXT = build.HEADER.read_text()


def _batch_fields(**replace) -> list:
    """LdBatch's fields with some (name -> (new name, type)) replaced in place."""
    return [replace.get(name, (name, t)) for name, t in LdBatch._fields_]


def test_real_build_matches_its_header():
    lib = bindings.library()
    assert lib.abi_version == abi.header_constant(HEADER_TEXT, "PN_ABI_VERSION")
    assert lib.max_decode_tokens == abi.header_constant(HEADER_TEXT, "LD_MAX_TOKENS")
    assert lib.max_panel_decode_tokens == abi.header_constant(HEADER_TEXT, "LD_PANEL_MAX_TOKENS")
    assert [lib.dtype_code(dt) for dt in (torch.float32, torch.float16, torch.bfloat16)] == [0, 1, 2]
    for mirror in (LdModel, LdBatch):
        lib.check_struct(mirror)
    assert set(abi.parse_prototypes(HEADER_TEXT)) == set(bindings.SIGNATURES)


def test_swapped_struct_fields_fail_the_load_naming_the_field(monkeypatch):
    fields = _batch_fields(num_reqs=("max_blocks", ctypes.c_int32), max_blocks=("num_reqs", ctypes.c_int32))
    swapped = type("LdBatch", (ctypes.Structure,), {"_fields_": fields})
    monkeypatch.setattr(bindings, "STRUCTS", (LdModel, swapped))
    with pytest.raises(NativeLibraryError, match=r"LdBatch\.max_blocks: the ctypes mirror has offset 48 size 4, "
                                                 r"the C struct offset 52 size 4"):
        NativeLibrary(bindings.library().path)


def test_wrong_field_type_and_missing_field_are_caught():
    lib = bindings.library()
    narrow_fields = _batch_fields(num_tokens=("num_tokens", ctypes.c_int32))
    narrow = type("LdBatch", (ctypes.Structure,), {"_fields_": narrow_fields})
    with pytest.raises(NativeLibraryError, match=r"LdBatch\.num_tokens: .* size 4, the C struct offset 64 size 8"):
        lib.check_struct(narrow)
    short = type("LdBatch", (ctypes.Structure,), {"_fields_": LdBatch._fields_[:-1]})
    with pytest.raises(NativeLibraryError, match=r"LdBatch: the ctypes mirror has size 104 and 14 fields, the C "
                                                 r"struct 112 and 15"):
        lib.check_struct(short)
    unknown = type("LdNothing", (ctypes.Structure,), {"_fields_": [("x", ctypes.c_int)]})
    with pytest.raises(NativeLibraryError, match="no struct 'LdNothing'"):
        lib.check_struct(unknown)


def test_argtypes_are_checked_against_the_header_prototypes():
    sigs = dict(bindings.SIGNATURES)
    restype, args = sigs["pa_attention"]
    sigs["pa_attention"] = (restype, [*args[:20], ctypes.c_int32, *args[21:]])  # scale declared as an int
    with pytest.raises(NativeLibraryError, match=r"pa_attention: argument 20 \(scale\) is f32 in "
                                                 r"pagedllm_native.h, the bindings declare c_int"):
        abi.check_signatures(sigs, HEADER_TEXT)
    sigs["pa_attention"] = (restype, args[:-1])
    with pytest.raises(NativeLibraryError, match=f"pa_attention: {len(args)} arguments in pagedllm_native.h, the "
                                                 f"bindings declare {len(args) - 1}"):
        abi.check_signatures(sigs, HEADER_TEXT)
    del sigs["pa_attention"]
    with pytest.raises(NativeLibraryError, match=r"exports \['pa_attention'\] without bindings"):
        abi.check_signatures(sigs, HEADER_TEXT)


def test_constants_are_read_back_and_an_abi_mismatch_fails(tmp_path):
    lib = bindings.library()
    assert lib.constant("ERR_META") == -3
    with pytest.raises(NativeLibraryError, match="no constant 'NO_SUCH'"):
        lib.constant("NO_SUCH")
    header = tmp_path / build.HEADER.name
    header.write_text(HEADER_TEXT.replace(f"#define PN_ABI_VERSION {lib.abi_version}",
                                          f"#define PN_ABI_VERSION {lib.abi_version + 1}"))
    with pytest.raises(NativeLibraryError, match=f"ABI {lib.abi_version}, but .* declares {lib.abi_version + 1}"):
        NativeLibrary(lib.path, header=header)


def test_editing_the_header_changes_the_build_key(tmp_path):
    cc = build.find_compiler()
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    assert build.build_key(cc, csrc=csrc) == build.build_key(cc)  # keyed by content, not by path
    header = csrc / build.HEADER.name
    header.write_text(header.read_text() + "/* edited */\n")
    assert build.build_key(cc, csrc=csrc) != build.build_key(cc)
    assert build.sources(csrc) == sorted(csrc.glob("*.c")) and len(build.sources(csrc)) == 14  # with threads.c


def test_fp8_max_is_read_from_the_header_the_kernels_use():
    """One declaration: the header's PN_FP8_E4M3_MAX is what the library exports and what the
    Python FP8 path scales by, and it is float8_e4m3fn's largest finite value."""
    from pagedllm.layers.quantization import fp8
    assert fp8.FP8_MAX == bindings.library().constant("FP8_E4M3_MAX") == torch.finfo(torch.float8_e4m3fn).max

