"""Never stale by execution: no false alarm, and no twin where Python code would see other ops.

* False alarms: a refusal when nothing the forward runs changed is a defect. The probe compares
  NaN and +-inf by position (a block whose weights hold inf gives NaN in both: diffusers'
  ``test_lora_fuse_nan``), runs in the block's own dtype and device (bf16 on the CPU:
  ``test_lora_layerwise_casting_inference``), and a class entry no forward reads (``__doc__``,
  ``abc``'s bookkeeping) is no change of the code.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plusequals import RustBlock, swap_transformer_blocks
from plusequals.twin import block as block_module
from plusequals.twin.probe import bound, differs
from plusequals.twin.reads import INERT, code_reads

peft = pytest.importorskip("peft", reason="needs the optional extra plusequals[diffusers]")
pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
from peft import LoraConfig  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402

from test_lora import call, inputs, lora_block  # noqa: E402
from test_sd_features import make_unet  # noqa: E402

LORA = {"r": 4, "lora_alpha": 4, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": False}


def unet_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    sample, text = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g)
    return sample.to(dtype), torch.tensor([10, 700]), text.to(dtype)


def add_unet_adapter(unet, name="adapter-1"):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        unet.add_adapter(LoraConfig(**LORA), adapter_name=name)


def run(unet, dtype=torch.float32):
    with torch.no_grad():
        return unet(*unet_inputs(dtype)).sample


def swapped_and_reference():
    """A tiny UNet swapped (and called once: probed in fp32), and an unswapped copy."""
    unet, reference = make_unet(), make_unet()
    swap_transformer_blocks(unet)
    run(unet)
    return unet, reference


# ------------------------------------------------------------------------------------ false alarms


VALUES = st.sampled_from([0.0, 1.0, -2.5, 3e-3, float("nan"), float("inf"), float("-inf")])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(VALUES, min_size=1, max_size=12), st.integers(0, 11), VALUES)
def test_the_probe_compares_nan_and_inf_by_position(values, where, other):
    """Equal tensors agree whatever they hold (all NaN included); one value changed to another
    kind (a NaN, an inf of either sign, a finite value far off) is a difference."""
    a = torch.tensor(values, dtype=torch.float64)
    assert differs(a.clone(), a, 1e-5) is None
    b = a.clone()
    b[where % len(values)] = other
    old, new = a[where % len(values)].item(), other
    same = (old != old and new != new) or old == new
    assert (differs(b, a, 1e-5) is None) == same, (values, where, other)


def test_lora_fuse_nan_gives_nan_like_the_library_and_no_refusal():
    """diffusers' test_lora_fuse_nan: every lora_A holds inf, fused unsafely; the probe (new peft
    classes in the forward) sees NaN from both blocks in the same places, and the call runs."""
    unet, reference = swapped_and_reference()
    for model in (unet, reference):
        add_unet_adapter(model)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, BaseTunerLayer) and hasattr(m, "lora_A"):
                    m.lora_A["adapter-1"].weight += float("inf")
        with pytest.raises(ValueError):
            model.fuse_lora(safe_fusing=True)
        model.fuse_lora(safe_fusing=False)
    got, expected = run(unet), run(reference)
    assert torch.isnan(expected).all() and torch.isnan(got).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_layerwise_casting_inference_runs_and_equals_the_library(dtype):
    """diffusers' test_lora_layerwise_casting_inference, on a UNet probed in fp32 first: cast to a
    half dtype, an adapter added, layerwise casting on; the probe runs in that dtype on the CPU
    and the output is bitwise the library's."""
    unet, reference = swapped_and_reference()
    for model in (unet, reference):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # diffusers warns that it casts with to()
            model.to(dtype)
        add_unet_adapter(model)
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype)
    assert torch.equal(run(unet, dtype), run(reference, dtype))


def test_the_bound_is_the_parity_bar_in_fp32_and_one_unit_in_half_dtypes():
    assert bound(torch.float32) == bound(torch.float64) == 1e-5
    assert bound(torch.bfloat16) == 2**-7 and bound(torch.float16) == 2**-10


def test_a_class_entry_no_forward_reads_is_no_change_of_the_code(monkeypatch):
    """``__doc__`` and abc's bookkeeping on a class in the forward's MRO (peft's layers are ABCs)
    are not noted: setting them runs no probe, and the output is the library's."""
    block = lora_block(seed=5)
    rust = RustBlock.from_torch(block)
    x, c = inputs()
    labels = {n.label.rsplit(".", 1)[-1] for n in code_reads(list(block.modules()))}
    assert not labels & INERT and "forward" in labels
    probes = []
    original = block_module.probe
    monkeypatch.setattr(block_module, "probe", lambda *a: probes.append(1) or original(*a))
    monkeypatch.setattr(BaseTunerLayer, "__doc__", "patched")
    monkeypatch.setattr(BaseTunerLayer, "__abstractmethods__", frozenset())
    with torch.no_grad():
        assert torch.equal(rust(x, c), call(block, x, c))
    assert probes == [] and rust._code_changes == []
