"""`bench decode --profile`'s table of where a step's device time goes (sdk/bench/kernel_groups.py):
our Triton kernels under the module that defines them, the rest by name; ms and launches a step."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from dayzero.sdk.bench.kernel_groups import from_profile, group_kernels, group_of, table, triton_owners

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


@needs_triton
def test_our_triton_kernels_are_owned_by_the_module_that_defines_them() -> None:
    owners = triton_owners()
    # _merge_splits is launched by the MLA wrapper but defined with the paged attention
    want = {"_gate_up_swiglu": "moe", "_mla_decode": "mla", "_merge_splits": "attention",
            "_index_topk": "topk", "packed_gemv_fp4": "packed_gemv", "_swiglu": "fused"}  # fmt: skip
    assert {k: owners[k] for k in want} == {k: f"triton {v}" for k, v in want.items()}


@needs_triton
def test_kernels_are_grouped_and_summed_a_step() -> None:
    steps = 8
    profile = [  # (name, device us over the steps, launches over the steps), as torch.profiler has them
        ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", 4000.0, 64),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4>", 800.0, 16),
        ("_gate_up_swiglu", 5496.0, 56),
        ("_down", 2992.0, 56),
        ("_mla_decode", 1200.0, 64),
        ("_merge_splits", 400.0, 64),
        ("Memcpy HtoD (Pinned -> Device)", 40.0, 8),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 96.0, 48),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 300.0, 16),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 80.0, 8),
    ]
    groups = group_kernels(profile, steps)
    by = {g.name: g for g in groups}
    assert set(by) == {
        "cuBLAS",
        "triton moe",
        "triton mla",
        "triton attention",
        "copies",
        "other",
        "NCCL",
        "SDPA",
    }
    assert by["cuBLAS"].ms == pytest.approx(0.6) and by["cuBLAS"].launches == 10
    assert by["triton moe"].ms == pytest.approx(1.061) and by["triton moe"].launches == 14
    assert by["triton mla"].launches == 8 and by["triton attention"].ms == pytest.approx(0.05)
    assert [g.name for g in groups][:2] == ["triton moe", "cuBLAS"]  # most device time first
    text = table(groups)
    lines = text.splitlines()
    assert lines[-1].split()[:3] == ["all", f"{sum(us for _, us, _ in profile) / 1e3 / steps:.3f}", "50.0"]
    assert "_gate_up_swiglu 0.687" in text


def test_names_outside_ours_fall_to_their_pattern_or_other() -> None:
    assert group_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", {}) == "cuBLAS"
    assert group_of("Memset (Device)", {}) == "copies"
    assert group_of("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", {}) == "other"
    assert group_of("_down", {"_down": "triton moe"}) == "triton moe"


def test_a_profile_gives_its_gpu_kernels_only() -> None:
    """From torch.profiler's key averages: the CUDA events (kernels, copies), not the host ops
    that launched them nor the engine's ranges' spans on the GPU (their device time would count
    each kernel twice)."""
    avg = [
        SimpleNamespace(key="aten::mm", self_device_time_total=0.0, count=4, device_type=DeviceType.CPU),
        SimpleNamespace(
            key="cudaLaunchKernel", self_device_time_total=0.0, count=6, device_type=DeviceType.CPU
        ),
        SimpleNamespace(
            key="nvjet_tst_64x8", self_device_time_total=400.0, count=4, device_type=DeviceType.CUDA
        ),
        SimpleNamespace(
            key="Memset (Device)", self_device_time_total=20.0, count=2, device_type=DeviceType.CUDA
        ),
        SimpleNamespace(
            key="dayzero.verify", self_device_time_total=900.0, count=2, device_type=DeviceType.CUDA
        ),
    ]
    groups = {g.name: g for g in from_profile(avg, 2)}
    assert set(groups) == {"cuBLAS", "copies"}
    assert groups["cuBLAS"].ms == pytest.approx(0.2) and groups["cuBLAS"].launches == 2
    assert groups["copies"].launches == 1
