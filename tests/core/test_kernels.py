"""tightfit.kernels: the dispatcher's rule, and index_rows' Triton kernels (interpreter, CPU) vs the reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.runif import RunIf
from tightfit.kernels import (
    ENV_VAR,
    KernelError,
    choose_backend,
    gather_rows,
    get_kernel,
    kernel_names,
    register_kernel,
    scatter_add_rows,
    scatter_rows,
    triton_available,
)
from tightfit.kernels.dispatch import CHECK_ENV_VAR, interpreter_enabled, repeated_calls
from tightfit.kernels.testing import FLOAT_DTYPES, ODD_SHAPES, assert_matches_reference

triton_interp = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")


def _table(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(rows, cols, generator=g).to(dtype)
    return torch.randint(-100, 100, (rows, cols), generator=g, dtype=dtype)


def _index(n: int, rows: int, idx_dtype: torch.dtype, seed: int = 1, unique: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if rows == 0:
        return torch.empty(0, dtype=idx_dtype)
    if unique:
        return torch.randperm(rows, generator=g)[:n].to(idx_dtype)
    return torch.randint(0, rows, (n,), generator=g).to(idx_dtype)


# ---------------------------------------------------------------------------- dispatcher


def test_auto_picks_reference_on_cpu(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert choose_backend(torch.ones(2)) == "reference"


def test_env_var_forces_and_is_validated(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert choose_backend(torch.ones(2)) == "reference"
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(KernelError, match=r"TIGHTFIT_KERNELS='cuda' is not a kernel backend.*reference, triton"):
        choose_backend(torch.ones(2))


def test_call_argument_overrides_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    assert choose_backend(torch.ones(2), backend="reference") == "reference"
    with pytest.raises(KernelError, match=r"backend='fast' is not one of"):
        choose_backend(torch.ones(2), backend="fast")


@RunIf(triton=True)
def test_forced_triton_on_cpu_without_interpreter_names_the_fix(monkeypatch):
    # Import Triton first: it decides interpreter-or-compiler for its own jit functions at import time.
    assert triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelError, match=r"tensors are on cpu.*TRITON_INTERPRET=1.*TIGHTFIT_KERNELS=reference"):
        choose_backend(torch.ones(2), backend="triton", name="gather_rows")


def test_registry_is_strict():
    assert {"gather_rows", "scatter_rows", "scatter_add_rows"} <= set(kernel_names())
    with pytest.raises(KernelError, match=r"already registered"):
        register_kernel("gather_rows", reference=lambda: None, triton=lambda: None)
    with pytest.raises(KernelError, match=r"unknown kernel 'nope'; registered kernels: .*gather_rows"):
        get_kernel("nope")


def test_env_var_routes_calls(monkeypatch):
    """With TIGHTFIT_KERNELS=triton a plain call really runs the Triton launcher (seen through the registry)."""
    seen = []
    k = register_kernel("_probe_kernel_for_test", reference=lambda x: seen.append("reference") or x,
                        triton=lambda x: seen.append("triton") or x)
    monkeypatch.setenv(ENV_VAR, "reference")
    k(torch.ones(1))
    monkeypatch.delenv(ENV_VAR)
    k(torch.ones(1))
    assert seen == ["reference", "reference"]
    if interpreter_enabled() and triton_available():
        monkeypatch.setenv(ENV_VAR, "triton")
        k(torch.ones(1))
        assert seen[-1] == "triton"


def test_repeated_calls_decide_once_per_block(monkeypatch):
    """Under repeated_calls() a kernel keeps its first call's implementation; outside, the environment rules."""
    seen = []
    k = register_kernel("_repeat_kernel_for_test", reference=lambda x: seen.append("reference") or x, triton=None,
                        native=lambda x: seen.append("native") or x, native_error=lambda: "")
    monkeypatch.setenv(CHECK_ENV_VAR, "0")
    x = torch.ones(1)
    with repeated_calls():
        k(x)
        monkeypatch.setenv(ENV_VAR, "reference")  # a caller of repeated_calls promises not to do this...
        k(x)  # ...so the block's first decision still holds
        assert k(x, backend="reference") is x  # an explicit backend decides for itself
        with repeated_calls():  # a nested block starts afresh
            k(x)
    k(x)
    assert seen == ["native", "native", "reference", "reference", "reference"]


def test_core_cuda_imports_without_triton():
    code = ("import sys, importlib.abc\n"
            "class B(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, n, p=None, t=None):\n"
            "        if n.split('.')[0] == 'triton': raise ImportError('blocked')\n"
            "sys.meta_path.insert(0, B())\n"
            "import torch, tightfit.kernels as c\n"
            "assert 'triton' not in sys.modules\n"
            "assert c.triton_available() is False\n"
            "print(c.gather_rows(torch.arange(6.).view(3, 2), torch.tensor([2])).tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[4.0, 5.0]]"


# ---------------------------------------------------------------------------- kernels vs reference


@RunIf(triton=True)
@triton_interp
@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("dtype", (*FLOAT_DTYPES, torch.int64))
def test_gather_rows_matches_reference(shape, dtype):
    rows, cols = shape
    src = _table(rows, cols, dtype)
    for idx_dtype in (torch.int32, torch.int64):
        index = _index(2 * rows + 3 if rows else 0, rows, idx_dtype)
        out = torch.empty(index.shape[0], cols, dtype=dtype)
        got = assert_matches_reference(get_kernel("gather_rows"), src, index, out)
        assert torch.equal(got, src[index.long()])  # a copy is exact at any dtype


@RunIf(triton=True)
@triton_interp
@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scatter_rows_matches_reference(shape, dtype):
    rows, cols = shape
    dst = _table(rows, cols, dtype, seed=2)
    index = _index(max(rows // 2, min(rows, 1)), rows, torch.int64, unique=True)
    src = _table(index.shape[0], cols, dtype, seed=3)
    got = assert_matches_reference(get_kernel("scatter_rows"), dst, index, src)
    expect = dst.clone()
    expect[index] = src
    assert torch.equal(got, expect)


@RunIf(triton=True)
@triton_interp
@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scatter_add_rows_matches_reference_with_duplicates(shape, dtype):
    rows, cols = shape
    dst = _table(rows, cols, dtype, seed=4)
    index = _index(3 * rows + 1 if rows else 0, rows, torch.int32)  # many duplicates
    src = _table(index.shape[0], cols, dtype, seed=5)
    got = assert_matches_reference(get_kernel("scatter_add_rows"), dst, index, src)
    # Independent check in float64.
    expect = dst.double().index_add_(0, index.long(), src.double())
    torch.testing.assert_close(got.double(), expect, atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=1e-2)


@RunIf(triton=True)
@triton_interp
def test_scatter_add_rows_keeps_float64_precision():
    # 1 + 3e-9 is 1.0 in fp32: a kernel that sums fp64 rows in fp32 loses every update here.
    dst = torch.ones(2, 5, dtype=torch.float64)
    src = torch.full((3, 5), 1e-9, dtype=torch.float64)
    got = scatter_add_rows(dst.clone(), torch.zeros(3, dtype=torch.int64), src, backend="triton")
    assert torch.equal(got[0], torch.full((5,), 1.0 + 3e-9, dtype=torch.float64))
    assert torch.equal(got[1], dst[1])


@RunIf(triton=True)
@triton_interp
def test_strided_views_and_skewed_indices():
    """Non-contiguous tables (a transposed view) and a hot row hit 50 times, as frequency-skewed lookups do."""
    base = _table(24, 40, torch.float32)
    table = base.t()  # (40, 24), strides (1, 40)
    index = torch.cat([torch.full((50,), 7), torch.arange(40)])
    got = gather_rows(table, index, backend="triton")
    assert torch.equal(got, table[index])
    dst = torch.zeros(40, 24).t().contiguous().t()  # same strides as `table`
    src = torch.ones(index.shape[0], 24)
    scatter_add_rows(dst, index, src, backend="triton")
    assert dst[7].tolist() == [51.0] * 24 and dst[8].tolist() == [1.0] * 24
    sub = torch.zeros(40, 48)[:, ::2]  # column stride 2
    scatter_rows(sub, torch.arange(40), table, backend="triton")
    assert torch.equal(sub, table)


@RunIf(triton=True)
@triton_interp
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gather_rows_autograd(backend):
    src = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([8, 0, 8, 3, 8])
    out = gather_rows(src, index, backend=backend)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    expect = torch.zeros(9, 5, dtype=torch.float64).index_add_(0, index, weights)
    torch.testing.assert_close(src.grad, expect)
    assert torch.autograd.gradcheck(lambda s: gather_rows(s, index, backend=backend), (src.detach().requires_grad_(),))


_COMPILE = """
import os, warnings
warnings.simplefilter("ignore")
os.environ.pop("TRITON_INTERPRET", None)
from tightfit.kernels import index_rows
from tightfit.kernels.testing import compile_for_gpu
k = index_rows._kernels()
for dt in ("fp32", "bf16", "fp16"):
    for idx in ("i32", "i64"):
        sig = {"src_ptr": "*" + dt, "idx_ptr": "*" + idx, "out_ptr": "*" + dt, "n_idx": "i32", "n_cols": "i32",
               **{n: "i64" for n in ("src_s0", "src_s1", "out_s0", "out_s1")}, "BLOCK_M": "constexpr", "BLOCK_D": "constexpr"}
        assert compile_for_gpu(k["gather"], sig, {"BLOCK_M": 32, "BLOCK_D": 128})["cubin"]
        sig = {"dst_ptr": "*" + dt, "idx_ptr": "*" + idx, "src_ptr": "*" + dt, "n_idx": "i32", "n_cols": "i32",
               **{n: "i64" for n in ("dst_s0", "dst_s1", "src_s0", "src_s1")}, "BLOCK_M": "constexpr", "BLOCK_D": "constexpr"}
        assert compile_for_gpu(k["scatter"], sig, {"BLOCK_M": 32, "BLOCK_D": 128})["cubin"]
for dt in ("fp32", "bf16", "fp16", "fp64"):  # fp64 rows are summed in fp64, the others in fp32
    sig = {"dst_ptr": "*" + dt, "src_ptr": "*" + dt, "sorted_idx_ptr": "*i64", "order_ptr": "*i64", "starts_ptr": "*i64",
           "ends_ptr": "*i64", "n_cols": "i32", **{n: "i64" for n in ("dst_s0", "dst_s1", "src_s0", "src_s1")},
           "BLOCK_D": "constexpr", "ACC": "constexpr"}
    acc = index_rows.tl.float64 if dt == "fp64" else index_rows.tl.float32
    assert compile_for_gpu(k["scatter_add"], sig, {"BLOCK_D": 128, "ACC": acc})["cubin"]
print("compiled")
"""


@RunIf(triton=True)
def test_kernels_compile_for_sm90_without_a_gpu():
    """The real code generator (not the interpreter) accepts every kernel at fp32/bf16/fp16, int32/int64 indices."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiled" in out.stdout


# ---------------------------------------------------------------------------- errors


def test_errors_name_value_rule_and_fix():
    table = torch.zeros(4, 3)
    with pytest.raises(IndexError, match=r"index value 4 is out of range for a table of 4 rows; .*0 <= index < 4"):
        gather_rows(table, torch.tensor([0, 4]))
    with pytest.raises(IndexError, match=r"index value -1 is out of range"):
        scatter_rows(table, torch.tensor([-1]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"must be 2-D .*got shape \(4,\)"):
        gather_rows(torch.zeros(4), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"1-D int32 or int64 tensor, got 1-D torch.float32.*\.long\(\)"):
        gather_rows(table, torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"src must have shape \(2, 3\).*got \(2, 4\)"):
        scatter_add_rows(table, torch.tensor([0, 1]), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"src dtype torch.float16 differs"):
        scatter_add_rows(table, torch.tensor([0, 1]), torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out must be a torch.float32 tensor of shape \(1, 3\)"):
        gather_rows(table, torch.tensor([0]), out=torch.empty(2, 3))


# ---------------------------------------------------------------------------- GPU benchmark harness

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@RunIf(triton=True)
def test_gpu_kernel_benchmark_smoke_runs_on_cpu(tmp_path):
    """benchmarks/gpu/kernels.py end to end at tiny sizes on the interpreter: checks equality, writes JSON to $OUT."""
    env = {**os.environ, "OUT": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu.kernels", "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["status"] == "ok"
    assert {r["op"] for r in data["results"]} == {"gather_rows", "scatter_rows", "scatter_add_rows", "paged_attention"}
    assert all(len(r["triton_s"]) == len(r["reference_s"]) >= 2 for r in data["results"])
    assert all(r["bandwidth_fraction"] > 0 for r in data["results"]) and data["params"]["copy_bandwidth_bytes_per_s"] > 0
    assert all(len(r["sdpa_s"]) >= 2 for r in data["results"] if r["op"] == "paged_attention")


def test_gpu_run_all_without_a_gpu_skips_and_prints_the_table(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this checks the CPU-only path")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run_all.sh"), "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout.split("GPU benchmarks", 1)[1]
    assert "kernels" in table and "skipped: no CUDA device" in table
