"""The audit does not change what runs: it watches module calls through torch's global module
hooks, so no module has a hook of its own. ``nn.TransformerEncoderLayer`` and
``nn.MultiheadAttention`` take their fused fast path (which a module hook switches off) as they
would unaudited, and the audit sees the fused op; the branches on grad mode and
``has_torch_function`` go the same way; a dispatch mode of the program sees the same ops, in the
same order (the audit's own reads of what autograd saved, and the outputs it keeps, add none); a
``ScriptModule`` inside a model is one call; a Rust twin inside an audited UNet still runs.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import examples
from plusequals.auditing import audit

FUSED = ("aten._transformer_encoder_layer_fwd.default", "aten._native_multi_head_attention.default")


class Count(TorchDispatchMode):
    """How many times each fused op runs."""

    def __init__(self) -> None:
        super().__init__()
        self.n: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in FUSED:
            self.n[str(func)] = self.n.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def _layer(norm_first: bool, batch_first: bool) -> nn.TransformerEncoderLayer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    return layer.eval()


class Keep(nn.Module):
    """Calls ``inner`` and keeps what it returned (no hook of its own on anything)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.out: List[object] = []

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.out.append(out)
        return out


def _plain_and_audited(model: nn.Module, *args, **kwargs):
    """``model(*args, **kwargs)`` plain and through ``audit()`` (inside a module that keeps its
    output): the outputs, the fused ops' counts, and the report."""
    with Count() as plain_count:
        plain = model(*args, **kwargs)
    keep = Keep(model)
    with Count() as audited_count:
        report = audit(keep, *args, **kwargs)
    return plain, keep.out[0], plain_count.n, audited_count.n, report


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_an_eval_encoder_layer_takes_its_fused_path_audited_as_plain(norm_first, batch_first, causal):
    layer = _layer(norm_first, batch_first)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g) if batch_first else torch.randn(5, 2, 16, generator=g)
    kwargs = {"src_mask": nn.Transformer.generate_square_subsequent_mask(5), "is_causal": True} if causal else {}
    with torch.no_grad():
        plain, audited, n_plain, n_audited, report = _plain_and_audited(layer, x, **kwargs)
    assert report.error is None and report.clean, (report.error, report.findings)
    # torch's fast path needs batch_first; either way the audited run takes the same path
    assert n_plain == n_audited and (sum(n_plain.values()) == 1) == batch_first, (n_plain, n_audited)
    assert torch.equal(plain, audited)
    # the audit's write watch, the innermost mode, dispatched the fused op before the counter saw it


def test_multihead_attention_takes_its_fused_path_audited_as_plain():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        (plain, _), (audited, _), n_plain, n_audited, report = _plain_and_audited(mha, x, x, x, need_weights=False)
    assert report.error is None and report.clean
    assert n_plain == n_audited == {"aten._native_multi_head_attention.default": 1}
    assert torch.equal(plain, audited)


@pytest.mark.parametrize("grad", [False, True])
def test_the_grad_mode_and_torch_function_branches_go_the_same_way(grad):
    """With grad on and parameters that need it the fast path is not taken, audited or not (and
    the output is the same); what a module sees of grad mode and ``has_torch_function`` is the
    same under the audit as without it."""

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = _layer(norm_first=True, batch_first=True)
            self.seen: List[tuple] = []

        def forward(self, x):
            self.seen.append(
                (
                    torch.is_grad_enabled(),
                    torch.overrides.has_torch_function((x,)),
                    torch._C._is_torch_function_mode_enabled(),
                    bool(self.layer._forward_hooks or self.layer._forward_pre_hooks),
                )
            )
            return self.layer(x)

    probe = Probe()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.set_grad_enabled(grad):
        plain, audited, n_plain, n_audited, report = _plain_and_audited(probe, x)
    assert report.error is None and report.clean
    assert probe.seen[0] == probe.seen[1] == (grad, False, False, False)
    assert n_plain == n_audited and (sum(n_plain.values()) == 0) == grad
    assert torch.equal(plain, audited)


class Ops(TorchDispatchMode):
    """Every op, in order (a program's own dispatch mode: a counter, a profiler)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# What a step adds to `h`: factories (whose output autograd gives no history: a second reference
# to it would make autograd hand over a detached copy), ops that save their output for backward,
# and a module call (a boundary, where the audit reads what autograd saved)
STEPS = {
    "ones": lambda m, h: torch.ones(3),
    "zeros_like": lambda m, h: torch.zeros_like(h),
    "full_like": lambda m, h: torch.full_like(h, 2.0),
    "rand_like": lambda m, h: torch.rand_like(h),
    "arange": lambda m, h: torch.arange(3.0),
    "new_ones": lambda m, h: h.new_ones(3),
    "tensor": lambda m, h: torch.tensor([1.0, 2.0, 3.0]),
    "to": lambda m, h: h.to(torch.float64).float(),
    "sigmoid": lambda m, h: h.sigmoid(),
    "exp": lambda m, h: (h * 0.1).exp(),
    "module": lambda m, h: m.inner(h),
}


class Steps(nn.Module):
    def __init__(self, steps: List[str]) -> None:
        super().__init__()
        self.steps = steps
        self.inner = nn.Sequential(nn.Linear(3, 3), nn.Sigmoid())

    def forward(self, x):
        h = x * 1.0
        for step in self.steps:
            h = h + STEPS[step](self, h)
        return h


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=6), st.booleans(), st.booleans())
def test_a_dispatch_mode_of_the_program_sees_the_same_ops_audited_as_plain(steps, grad, requires):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Steps(steps)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1)).requires_grad_(requires)
    keep = Keep(model)
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(grad), Ops() as plain:
        torch.manual_seed(2)
        expected = keep(x)
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(grad), Ops() as audited:
        torch.manual_seed(2)
        report = audit(keep, x)
    assert report.error is None and report.clean, (report.error, report.findings)
    assert audited.ops == plain.ops
    assert torch.equal(keep.out[1], expected)


def test_no_module_gets_a_hook_and_a_script_module_is_one_call():
    """No module has a hook while the audit runs, and torch's global hooks are as before after
    it; a scripted submodule (which refuses module hooks of its own) is watched as one call."""
    seen = []

    class Check(nn.Module):
        def forward(self, x):
            seen.append([bool(m._forward_hooks or m._forward_pre_hooks) for m in model.modules()])
            return x

    model = nn.Sequential(torch.jit.script(nn.Linear(3, 3)), nn.ReLU(inplace=True), Check())
    before = (dict(torch_module._global_forward_pre_hooks), dict(torch_module._global_forward_hooks))
    report = audit(model, torch.randn(2, 3, generator=torch.Generator().manual_seed(0)))
    assert report.error is None and report.clean and len(report.moves) == 1  # the ReLU's move
    assert report.modules == 4 and report.calls == 4
    assert seen == [[False] * 4]
    assert (dict(torch_module._global_forward_pre_hooks), dict(torch_module._global_forward_hooks)) == before


def test_a_keyword_argument_is_still_an_argument():
    """The global pre-hook is given no keyword arguments: the watch takes them from the call."""

    class Writes(nn.Module):
        def forward(self, x, *, extra):
            extra.add_(1.0)
            return x + extra

    class Calls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = Writes()

        def forward(self, x):
            e = x * 2.0
            y = self.w(x, extra=e)
            return y + e  # e was moved into `w`

    report = audit(Calls(), torch.randn(3, generator=torch.Generator().manual_seed(0)))
    (f,) = report.findings
    assert f.code == "E0382" and f.module == "w" and f.read_at.endswith(str(Calls.forward.__code__.co_firstlineno + 3))


def test_an_audited_unet_with_rust_blocks_runs_them_and_is_clean():
    """The twin refuses torch's global module hooks, but not the audit's, which only observe and
    see a twin as one module."""
    pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
    from plusequals import swap_transformer_blocks
    from plusequals.cases import project as cases

    unet, inputs = cases.tiny_unet(0, patched=False)
    swap_transformer_blocks(unet)
    keep = Keep(unet)
    with torch.no_grad():
        expected = unet(*inputs).sample
        report = audit(keep, *inputs)
    assert report.error is None and report.clean, (report.error, report.findings)  # a refusal raises
    assert torch.equal(keep.out[0].sample, expected)
