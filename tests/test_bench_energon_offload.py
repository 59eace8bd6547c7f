"""The llama.cpp peer's build flags (benchmarks/energon_offload.py): native, without the AMX kernels that crash here."""

from __future__ import annotations

import shlex

from benchmarks.energon_offload import llama_cmake_args

XEON = "flags\t\t: fpu sse avx2 avx512f avx512_vnni amx_bf16 amx_int8 amx_tile\n"
EPYC = "flags\t\t: fpu sse avx2 avx512f avx512_vnni\n"


def _defines(args: str) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in shlex.split(args) if a.startswith("-D"))


def test_amx_is_left_out_of_the_build_only_where_the_cpu_has_it():
    xeon, epyc = _defines(llama_cmake_args(XEON)), _defines(llama_cmake_args(EPYC))
    for flags in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"):
        assert set(xeon[flags].split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}
        assert flags not in epyc
    # Everything else is the same native build, with llama.cpp's extras off.
    assert {k: v for k, v in xeon.items() if not k.endswith("_FLAGS")} == epyc
    assert epyc["LLAMA_BUILD_SERVER"] == "OFF"


def test_a_flag_name_inside_another_word_is_not_amx():
    assert "CMAKE_C_FLAGS" not in _defines(llama_cmake_args("flags : avx2 no_amx_int8x\n"))
