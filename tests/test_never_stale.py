"""Never stale by execution: no false alarm, and no twin where Python code would see other ops.

* False alarms: a refusal when nothing the forward runs changed is a defect. The probe compares
  NaN and +-inf by position (a block whose weights hold inf gives NaN in both: diffusers'
  ``test_lora_fuse_nan``), runs in the block's own dtype and device (bf16 on the CPU:
  ``test_lora_layerwise_casting_inference``), and a class entry no forward reads (``__doc__``,
  ``abc``'s bookkeeping) is no change of the code.
* A user's TorchFunctionMode sees the PyTorch block's torch calls (``F.linear``, ``layer_norm``) and
  may change them; the twin is one call it cannot change. Under one, the PyTorch block's forward
  runs in place of the twin (``twin/delegate.py``), or, with no PyTorch block to run, the call is
  refused naming the mode; once the mode exits, the twin runs again.
* With parameters swapped on conversion (``torch.__future__``), ``.double()`` and
  ``load_state_dict`` on the PyTorch block a twin follows work: the twin lets go of the
  parameters first (``twin/letgo.py``) and follows.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from conftest import examples, make_block, make_inputs
from plusequals import CppBlock, OwnershipError, RustBlock, UnsupportedBlockError, swap_transformer_blocks
from plusequals.twin import follow as follow_module
from plusequals.twin.forward_code import INERT, code_reads
from plusequals.twin.probe import bound, differs

peft = pytest.importorskip("peft", reason="needs the optional extra plusequals[diffusers]")
pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
from peft import LoraConfig  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402

from support.lora import call, inputs, lora_block  # noqa: E402
from support.unet import unet_inputs  # noqa: E402

LORA = {"r": 4, "lora_alpha": 4, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": False}


def add_unet_adapter(unet, name="adapter-1"):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        unet.add_adapter(LoraConfig(**LORA), adapter_name=name)


def run(unet, dtype=torch.float32):
    with torch.no_grad():
        return unet(*unet_inputs(dtype=dtype)).sample


def swapped_and_reference(tiny_unet):
    """A tiny UNet swapped (and called once: probed in fp32), and an unswapped copy."""
    unet, reference = tiny_unet(), tiny_unet()
    swap_transformer_blocks(unet)
    run(unet)
    return unet, reference


# ------------------------------------------------------------------------------------ false alarms


VALUES = st.sampled_from([0.0, 1.0, -2.5, 3e-3, float("nan"), float("inf"), float("-inf")])


@settings(max_examples=examples(200), deadline=None, derandomize=True)
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


def test_lora_fuse_nan_gives_nan_like_the_library_and_no_refusal(tiny_unet):
    """diffusers' test_lora_fuse_nan: every lora_A holds inf, fused unsafely; the probe (new peft
    classes in the forward) sees NaN from both blocks in the same places, and the call runs."""
    unet, reference = swapped_and_reference(tiny_unet)
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
def test_lora_layerwise_casting_inference_runs_and_equals_the_library(tiny_unet, dtype):
    """diffusers' test_lora_layerwise_casting_inference, on a UNet probed in fp32 first: cast to a
    half dtype, an adapter added, layerwise casting on; the probe runs in that dtype on the CPU
    and the output is bitwise the library's."""
    unet, reference = swapped_and_reference(tiny_unet)
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
    original = follow_module.probe
    monkeypatch.setattr(follow_module, "probe", lambda *a: probes.append(1) or original(*a))
    monkeypatch.setattr(BaseTunerLayer, "__doc__", "patched")
    monkeypatch.setattr(BaseTunerLayer, "__abstractmethods__", frozenset())
    with torch.no_grad():
        assert torch.equal(rust(x, c), call(block, x, c))
    assert probes == [] and rust._follow.code_changes == []


# ----------------------------------------------------------------------------- function modes


class AddOneToLinear(TorchFunctionMode):
    """Changes what the PyTorch block computes: every F.linear's output plus one."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        out = func(*args, **(kwargs or {}))
        return out + 1 if func is F.linear else out


class ScaleLayerNorm(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 1.5 if func is F.layer_norm else out


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


MODES = {"add one to F.linear": AddOneToLinear, "scale F.layer_norm": ScaleLayerNorm, "pass through": PassThrough}


def small():
    block = make_block(dim=32, heads=4, d_head=8, context_dim=24, seed=3)
    x, c = make_inputs(tokens=6, dim=32)
    return block, x, c[..., :24].contiguous()


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_under_a_mode_that_changes_f_linear_the_pytorch_block_runs(cls):
    block, x, c = small()
    twin = cls.from_torch(block)
    with torch.no_grad():
        plain = block(x, c)
        with AddOneToLinear() as expected_mode:
            expected = block(x, c)
        with AddOneToLinear() as mode:
            got = twin(x, c)
        with AddOneToLinear():
            owned = twin.forward_owned(x, c)
    assert not torch.equal(expected, plain)  # the mode changes the PyTorch block
    assert torch.equal(got, expected) and torch.equal(owned, expected)
    assert mode.calls == expected_mode.calls and "linear" in mode.calls  # it saw the block's own calls
    with torch.no_grad():
        assert torch.equal(twin(x, c), plain) and twin._entry is not None  # the twin again, on the hot path


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_under_a_mode_gradients_are_the_pytorch_blocks(cls):
    block, x, c = small()
    twin = cls.from_torch(block)
    grads = []
    for module in (block, twin):
        xg = x.clone().requires_grad_()
        with AddOneToLinear():
            module(xg, c).square().sum().backward()
        grads.append([xg.grad] + [p.grad.clone() for p in block.parameters()])
        block.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_under_a_mode_a_donation_is_refused_and_a_state_dict_block_is_refused_naming_it():
    """No PyTorch block to run (from_state_dict): refused naming the mode; a donation is refused as
    before. The inputs are bitwise unchanged and the block works once the mode exits."""
    block, x, c = small()
    weights = {k: v.detach().clone() for k, v in block.state_dict().items()}
    built = RustBlock.from_state_dict(weights, dim=32, n_heads=4, d_head=8, context_dim=24)
    follows = RustBlock.from_torch(block)
    before = x.clone()
    with torch.no_grad(), AddOneToLinear():
        with pytest.raises(UnsupportedBlockError, match=r"TorchFunctionMode is active \(AddOneToLinear\)"):
            built(x, c)
        with pytest.raises(UnsupportedBlockError, match="AddOneToLinear"):
            built.forward_owned(x, c)
        with pytest.raises(OwnershipError, match="AddOneToLinear"):
            follows.forward_owned(x, c, donate=True)
    assert torch.equal(x, before) and type(x) is torch.Tensor
    with torch.no_grad():
        assert torch.equal(built(x, c), block(x, c)) and torch.equal(follows(x, c), block(x, c))


def test_a_submodule_replaced_on_the_twin_only_is_refused_under_a_mode():
    block, x, c = small()
    twin = RustBlock.from_torch(block)
    twin.norm1 = torch.nn.LayerNorm(32)
    with torch.no_grad(), AddOneToLinear():
        with pytest.raises(UnsupportedBlockError, match="its norm1 was replaced here"):
            twin(x, c)


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_a_twin_made_under_a_mode_is_probed_outside_it(cls):
    """The probe checks the block's code, not a mode around the call: a twin made (and probed)
    under a mode that changes F.linear is accepted, gives the PyTorch block's result under the
    mode, and the twin's outside it."""
    block, x, c = small()
    with torch.no_grad(), AddOneToLinear():
        twin = cls.from_torch(block)
        assert torch.equal(twin(x, c), block(x, c))
    with torch.no_grad():
        assert torch.equal(twin(x, c), block(x, c)) and twin._entry is not None


@settings(max_examples=examples(25), deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.sampled_from([None, *MODES]), st.booleans(), st.sampled_from(["rust", "cpp"])), max_size=8)
)
def test_generated_calls_in_and_out_of_modes_equal_the_pytorch_block(steps):
    """Each step: a call (forward or forward_owned, Rust or C++ twin) under one of the modes or
    none, against the PyTorch block under the same mode: bitwise (fp32 on the CPU)."""
    block, x, c = small()
    twins = {"rust": RustBlock.from_torch(block), "cpp": CppBlock.from_torch(block)}
    for mode, owned, which in steps:
        twin = twins[which]
        with torch.no_grad():
            with MODES[mode]() if mode else contextlib.nullcontext():
                expected = block(x, c)
            with MODES[mode]() if mode else contextlib.nullcontext():
                got = twin.forward_owned(x, c) if owned else twin(x, c)
        assert torch.equal(got, expected), (mode, owned, which)


def test_a_swapped_unet_under_a_mode_is_the_librarys_under_it(tiny_unet):
    """The swapped tiny UNet under a mode that changes F.linear gives the library's output under
    that mode (its blocks run diffusers' forward), and the twins again after it."""
    unet, reference = tiny_unet(), tiny_unet()
    handle = swap_transformer_blocks(unet)
    inputs = unet_inputs()
    with torch.no_grad():
        plain = reference(*inputs).sample
        with AddOneToLinear():
            expected = reference(*inputs).sample
        with AddOneToLinear():
            got = unet(*inputs).sample
        assert not torch.equal(expected, plain) and torch.equal(got, expected)
        assert torch.equal(unet(*inputs).sample, plain)
    assert all(s.replacement._entry is not None for s in handle)


# --------------------------------------------------------------------- input subclasses


class LinearPlusOne(torch.Tensor):
    """An input whose ``__torch_function__`` adds one to every ``F.linear`` it takes part in."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out + 1 if func is F.linear else out


class GeluTwice(torch.Tensor):
    """A wrapper whose ``__torch_dispatch__`` doubles every ``aten.gelu`` it takes part in (the
    GEGLU's): the ATen ops it sees are the PyTorch block's, whatever calls them."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, strides=elem.stride())

    def __init__(self, elem):
        self.elem = elem

    def __repr__(self):
        return f"GeluTwice({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, GeluTwice) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func is torch.ops.aten.gelu.default:
            out = out * 2
        return tree_map(lambda t: GeluTwice(t) if isinstance(t, torch.Tensor) else t, out)


SUBCLASSES = {"__torch_function__": lambda t: t.as_subclass(LinearPlusOne), "__torch_dispatch__": GeluTwice}


def plain(t):
    return t.elem if isinstance(t, GeluTwice) else t.as_subclass(torch.Tensor)


@settings(max_examples=examples(24), deadline=None, derandomize=True)
@given(
    hook=st.sampled_from(sorted(SUBCLASSES)),
    which=st.sampled_from(["x", "context", "both"]),
    cls=st.sampled_from([RustBlock, CppBlock]),
    owned=st.booleans(),
)
def test_an_input_subclass_that_changes_the_blocks_ops_gets_the_pytorch_blocks_result(hook, which, cls, owned):
    """An input tensor subclass whose own ``__torch_function__`` (or ``__torch_dispatch__``) changes
    the block's torch calls (or ATen ops) sees the PyTorch block's, which runs in the twin's place:
    bitwise its result, of its class; with plain inputs again, the twin runs."""
    block, x, c = small()
    twin = cls.from_torch(block)
    wrap = SUBCLASSES[hook]
    xs = wrap(x) if which in ("x", "both") else x
    cs = wrap(c) if which in ("context", "both") else c
    with torch.no_grad():
        expected = block(xs, cs)
        got = twin.forward_owned(xs, cs) if owned else twin(xs, cs)
        assert type(got) is type(expected) and torch.equal(plain(got), plain(expected)), (hook, which, owned)
        assert not torch.equal(plain(expected), block(x, c))  # the subclass changes the PyTorch block
        assert torch.equal(twin(x, c), block(x, c)) and twin._entry is not None
    assert type(x) is torch.Tensor and type(c) is torch.Tensor


@pytest.mark.parametrize("hook", sorted(SUBCLASSES))
def test_an_input_subclass_gets_the_pytorch_blocks_gradients_and_a_donation_is_refused(hook):
    """Under grad, the gradients are the PyTorch block's; a donation of such an input is refused
    (the Rust ops would bypass its Python code), leaving it as it was."""
    block, x, c = small()
    twin = RustBlock.from_torch(block)
    if hook == "__torch_function__":
        grads = []
        for module in (block, twin):
            xg = x.clone().as_subclass(LinearPlusOne).requires_grad_()
            module(xg, c).square().sum().backward()
            grads.append([xg.grad] + [p.grad.clone() for p in block.parameters()])
            block.zero_grad(set_to_none=True)
        assert all(torch.equal(plain(a), plain(b)) for a, b in zip(*grads))
    xs = SUBCLASSES[hook](x.clone())
    with torch.no_grad(), pytest.raises(OwnershipError, match="tensor subclass"):
        twin.forward_owned(xs, c, donate=True)
    assert type(xs) in (LinearPlusOne, GeluTwice) and torch.equal(plain(xs), x)


@pytest.mark.parametrize("hook", sorted(SUBCLASSES))
def test_a_state_dict_blocks_input_subclass_sees_the_twin_as_one_op(hook):
    """Built from a state dict, the twin is the only block there is: such an input sees it as one
    custom op (``plusequals::block_forward``), which its class applies like any other op."""
    block, x, c = small()
    weights = {k: v.detach().clone() for k, v in block.state_dict().items()}
    built = RustBlock.from_state_dict(weights, dim=32, n_heads=4, d_head=8, context_dim=24)
    seen = []

    class Logged(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        xs = SUBCLASSES[hook](x)
        with Logged():
            got = built(xs, c)
        expected = block(x, c)
    assert torch.equal(plain(got), expected)
    assert any("block_forward" in op for op in seen) and not any("gelu" in op for op in seen), seen


def test_a_swapped_unet_given_an_input_subclass_is_the_librarys(tiny_unet):
    """The swapped tiny UNet given a sample of such a class gives the library's output for it
    (its blocks run diffusers' forward), and the twins again for a plain sample."""
    unet, reference = tiny_unet(), tiny_unet()
    handle = swap_transformer_blocks(unet)
    sample, t, context = unet_inputs()
    for hook, wrap in SUBCLASSES.items():
        with torch.no_grad():
            expected = reference(wrap(sample), t, context).sample
            got = unet(wrap(sample), t, context).sample
            assert not torch.equal(plain(expected), reference(sample, t, context).sample), hook
            assert torch.equal(plain(got), plain(expected)), hook
            assert torch.equal(unet(sample, t, context).sample, reference(sample, t, context).sample)
    assert all(s.replacement._entry is not None for s in handle)


# ------------------------------------------------------------------- swapped parameters


CONVERSIONS = {
    "double": lambda m, seed: m.double(),
    "float": lambda m, seed: m.float(),
    "bfloat16": lambda m, seed: m.bfloat16(),
    "load_state_dict": lambda m, seed: m.load_state_dict({k: v * (1 + seed / 8) for k, v in m.state_dict().items()}),
    "load_state_dict(assign=True)": lambda m, seed: m.load_state_dict(
        {k: v * (1 - seed / 8) for k, v in m.state_dict().items()}, assign=True
    ),
}


def _same(twin, block, x, c):
    dtype = next(block.parameters()).dtype
    with torch.no_grad():
        got, expected = twin(x.to(dtype), c.to(dtype)), block(x.to(dtype), c.to(dtype))
    assert got.dtype == dtype and torch.equal(got, expected), dtype


@settings(max_examples=examples(20), deadline=None, derandomize=True)
@given(
    st.sampled_from([RustBlock, CppBlock]),
    st.lists(
        st.tuples(
            st.sampled_from(list(CONVERSIONS)), st.sampled_from(["original", "twin", "submodule"]), st.integers(0, 7)
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_conversions_that_swap_parameters_work_on_the_original_and_the_twin_follows(cls, steps):
    """Generated conversions with swapped parameters, on the original block (which the user still
    holds), one of its submodules, or the twin, each followed by a call: the twin gives the block's
    result, bitwise; the flag is restored after."""
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        block, x, c = small()
        twin = cls.from_torch(block)
        _same(twin, block, x, c)
        for name, where, seed in steps:
            if where == "submodule" and not name.startswith("load"):
                where = "original"  # one submodule in another dtype: the PyTorch block fails too
            target = {"original": block, "twin": twin, "submodule": block.attn2}[where]
            CONVERSIONS[name](target, seed)
            _same(twin, block, x, c)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)


def test_a_swapped_unets_original_blocks_convert_and_the_unet_follows(tiny_unet, swapping):
    unet, reference = tiny_unet(), tiny_unet()
    handle = swap_transformer_blocks(unet)
    inputs = unet_inputs()
    with torch.no_grad():
        assert torch.equal(unet(*inputs).sample, reference(*inputs).sample)
    for s in handle:
        s.original.double()
        s.original.float()
    unet.load_state_dict(reference.state_dict())
    with torch.no_grad():
        assert torch.equal(unet(*inputs).sample, reference(*inputs).sample)


def test_without_a_twin_swap_tensors_is_torchs_own(swapping):
    """No twin holds the tensors: torch's rules, a weak reference still refused."""
    import weakref

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(2))
    torch.utils.swap_tensors(a, b)
    assert torch.equal(a, torch.zeros(2)) and torch.equal(b, torch.ones(2))
    keep = weakref.ref(a)
    with pytest.raises(RuntimeError, match="weakref"):
        torch.utils.swap_tensors(a, b)
    assert keep() is a
