"""The sites the never-stale tests change (test_structure.py, test_routes.py,
test_watch_routes.py): a block's Rust or C++ twin, or the swapped tiny UNet; the oracle's verdict
on one change, and a sequence of changes applied and undone."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import CONTEXT, examples, make_block, make_inputs, rel_err
from plusequals import CppBlock, RustBlock, StaleBlock, UnsupportedBlockError
from support.unet import REPLACED, TinyUnets, unet_inputs

TOL = 1e-5
SCALE = 1.5  # what a change multiplies by
SITES = ["RustBlock", "CppBlock", "swap"]


class Site:
    """A PyTorch model, its Rust side, and the block inside it whose structure or code the cases
    change: a ``RustBlock`` or ``CppBlock`` of a block, or the swap of the tiny UNet (from
    ``tiny_unet``, conftest's fixture, where given; else built here)."""

    def __init__(self, name: str, tiny_unet: Optional[Callable[[], nn.Module]] = None) -> None:
        self.name = name
        if name == "swap":
            pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
            from plusequals import swap_transformer_blocks

            # swapped in place; the handle keeps the originals
            self.torch = self.rust = (tiny_unet or TinyUnets())()
            self.inputs = unet_inputs()
            self.handle = swap_transformer_blocks(self.torch)
            # the diffusers block whose submodules (the same objects) its replacement runs on
            self.block = next(s.original for s in self.handle if s.path == REPLACED)
        else:
            self.block = make_block(80, 8, 10, context_dim=CONTEXT[1])
            self.rust = (RustBlock if name == "RustBlock" else CppBlock).from_torch(self.block)
            self.inputs = make_inputs(16)

    def pytorch(self) -> torch.Tensor:
        """The PyTorch model's output now."""
        with torch.no_grad():
            if self.name == "swap":
                self.handle.undo()
                try:
                    return self.torch(*self.inputs).sample
                finally:
                    for s in self.handle:
                        setattr(s.parent, s.name, s.replacement)
                    self.handle.active = True
            return self.block(*self.inputs)

    def run(self) -> torch.Tensor:
        with torch.no_grad():
            if self.name == "swap":
                return self.rust(*self.inputs).sample
            return self.rust(*self.inputs)


def same_or_refused(site: Site, step: str) -> None:
    """The oracle's verdict on one step: the changed PyTorch model's output, or a refusal that
    leaves the inputs as they were."""
    expected = site.pytorch()
    inputs = [t.clone() for t in site.inputs if isinstance(t, torch.Tensor)]
    try:
        got = site.run()
    except (UnsupportedBlockError, StaleBlock):
        now = [t for t in site.inputs if isinstance(t, torch.Tensor)]
        assert all(torch.equal(a, b) for a, b in zip(inputs, now)), f"{step}: a refusal changed the inputs"
    else:
        assert rel_err(got, expected) <= TOL, f"{step}: stale by {rel_err(got, expected):.3g}"


def run_sequence(site: Site, routes: Dict[str, Callable[[Site], Callable[[], None]]], steps: list) -> None:
    """Applies each step's route (or undoes it when it is applied already), the oracle's verdict
    after each; then every change undone, the target must work again."""
    undos: Dict[str, Callable[[], None]] = {}
    try:
        for name in steps:  # a route applied, or undone when it is applied already
            if name in undos:
                undos.pop(name)()
                same_or_refused(site, f"{name} undone, after {steps}")
            else:
                undos[name] = routes[name](site)
                same_or_refused(site, f"{name}, in {steps}")
    finally:
        for undo in reversed(list(undos.values())):
            undo()
    assert rel_err(site.run(), site.pytorch()) <= TOL, f"every change undone, {steps}: it must work again"


def generated_sequences(names: List[str], budget: int = 12, longest: int = 5) -> Callable[[Callable], Callable]:
    """The decorator of a routes module's generated test, ``test(site, steps)``: hypothesis draws
    ``examples(budget)`` sequences (the profile's share of ``budget``: conftest) of up to
    ``longest`` of ``names`` (a name drawn again undoes it), which the test runs with
    :func:`run_sequence`."""
    return lambda test: settings(
        max_examples=examples(budget),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )(given(steps=st.lists(st.sampled_from(names), min_size=1, max_size=longest))(test))
