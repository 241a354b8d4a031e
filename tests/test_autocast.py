"""Autocast: under ``torch.autocast`` the Rust and C++ twins accept the dtype autocast produces
and compute what eager autocast computes (the autocast dispatch key is thread-local state, and
the Rust call runs on the caller's thread). Outside autocast, a dtype other than the weights'
is still refused. CUDA fp16/bf16 runs with the GPU checks (scripts/gpu_check.sh)."""

import pytest
import torch

from conftest import cuda, make_block, make_inputs, rel_err
from plusequals import CppBlock, RustBlock

# CPU bf16 autocast. The twins run the same ops in the same order as eager under the same
# autocast policy, so the results are measured bitwise equal; the bound documents what a
# different op order would be allowed (bf16 has 8 bits of mantissa: 2**-8 relative).
BF16_BOUND = 2**-8


@pytest.mark.parametrize("twin", [RustBlock, CppBlock], ids=["rust", "cpp"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["fp32-in", "bf16-in"])
def test_forward_under_cpu_autocast_matches_eager(twin, input_dtype):
    block = make_block()
    x, c = make_inputs(tokens=16)
    x, c = x.to(input_dtype), c.to(input_dtype)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = block(x, c)
        got = twin.from_torch(block)(x, c)
        owned = twin.from_torch(block).forward_owned(x, c)
        eager_iadd = block(x.clone(), c, residual="iadd")
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected), rel_err(got, expected)
    assert owned.dtype == eager_iadd.dtype and rel_err(owned, eager_iadd) <= BF16_BOUND


def test_a_dtype_autocast_did_not_produce_is_still_refused():
    block = make_block()
    x, c = make_inputs(tokens=16)
    rust = RustBlock.from_torch(block)
    with pytest.raises(
        ValueError,
        match=r"^x dtype torch.bfloat16 does not match the block's weights \(torch.float32\), and autocast is off",
    ):
        rust(x.bfloat16(), c)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="^x dtype torch.float16"):
        rust(x.half(), c)  # autocast makes bf16 here, not fp16


def test_swapped_unet_runs_under_autocast_like_eager(tiny_unet):
    from plusequals import swap_transformer_blocks
    from support.unet import unet_inputs

    unet = tiny_unet()
    sample, t, ehs = unet_inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = unet(sample, t, ehs).sample
        with swap_transformer_blocks(unet):
            got = unet(sample, t, ehs).sample
    assert got.dtype == expected.dtype
    assert rel_err(got, expected) <= BF16_BOUND, rel_err(got, expected)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("twin", [RustBlock, CppBlock], ids=["rust", "cpp"])
def test_forward_under_cuda_autocast_matches_eager(twin, dtype):
    """On CUDA the kernels autocast picks may differ between calls (cuBLAS heuristics), so the
    bound is the dtype's: 2**-10 for fp16 (10 mantissa bits), 2**-7 for bf16, relative."""
    block = make_block().cuda()
    x, c = make_inputs(tokens=64, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        expected = block(x, c)
        got = twin.from_torch(block)(x, c)
    assert got.dtype == expected.dtype == dtype
    assert rel_err(got, expected) <= (2**-10 if dtype == torch.float16 else 2**-7)
