"""Following the PyTorch block a twin was made from: :class:`Follow`.

A ``RustBlock`` made with ``from_torch`` (or the swap's block) must never compute with anything but
what the PyTorch forward would read now. Its :class:`Follow` holds that block (the *source*), the
last reading of it (:func:`plusequals.twin.faithful.read_block`, with its watch), and the probe's
state (what the forward's code was when the probe last agreed, what it ran). The twin drives it:
it asks whether the source moved (:meth:`Follow.stale`), has it read the source again
(:meth:`Follow.read`, which answers the reading the twin then computes with) and checks the code
where it must (:meth:`Follow.check_code`); Follow answers, or raises a refusal naming the twin. It
writes nothing of the twin's but the submodules it takes over, in the dict the twin gave it.
:mod:`plusequals.twin.delegate` (the PyTorch block run in the twin's place) and
:mod:`plusequals.twin.letgo` (letting go of the parameters before torch swaps one) use its
interface too.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import Tensor, nn

from ..errors import UnsupportedBlockError
from . import letgo
from .config import BlockConfig
from .faithful import ADAPTERS, CHILDREN, Reading, can_probe, probe, read_block
from .forward_code import code_changes
from .record import Ran, Recorder

__all__ = ["Follow"]

_SCALARS = (int, float, str, bool, tuple, type(None))
_NO_CASTING = (
    "diffusers' layerwise casting (enable_layerwise_casting) is on, and RustBlock.from_torch does not cast the "
    "stored weights around each call; swap the block (swap_transformer_blocks, RustTransformerBlock), which does"
)


class Follow:
    """The source module a twin follows, its reading and watch, and the probe's state.

    ``modules`` is the twin's submodule dict, where the source's six are registered; ``name``
    starts every refusal; ``casts_layerwise``: whether the twin runs diffusers' layerwise casting
    (the swap's does); ``holds(t)``: whether the twin's Rust block computes with the tensor ``t``;
    ``drop()``: drops it (the twin builds again on its next call). A copy of the twin
    (``copy.deepcopy``, pickling) copies the source and reads it again on first use."""

    def __init__(
        self,
        source: nn.Module,
        modules: Dict[str, Any],
        name: str,
        *,
        casts_layerwise: bool,
        holds: Callable[[Any], bool],
        drop: Callable[[], None],
        trust: Optional[str] = None,
    ) -> None:
        self.source = source
        self.modules = modules
        self.name = name
        self.casts_layerwise = casts_layerwise
        self.holds = holds
        self._drop = drop
        self.trust = trust  # from_torch(trust=...): see there
        self.reading: Optional[Reading] = None  # the last reading; None: read again at the next call
        self.kids: Dict[str, Any] = {}  # the source's six submodules at the last reading
        self.paths: Tuple[str, ...] = ()  # the weights as attribute paths (traced calls)
        self.guards: List[tuple] = []  # what a traced call compares (torch.compile guards on it)
        self.lora_layers: Tuple[str, ...] = ()  # peft LoRA layers in the last reading: never traced
        self.casting = False  # diffusers' layerwise casting in the last reading (twin/casting.py): never traced
        self.probe_pending = False  # unknown classes not yet probed in the current state, or new code
        # What the forward's code read (Watch.code: label -> value) when the probe last agreed, and
        # what differs from it in the last reading: the PyTorch block is the oracle for its code.
        self.code_ok: Optional[Dict[str, Any]] = None
        self.code_changes: List[str] = []
        self.ran: Optional[Ran] = None  # what the last probe that agreed ran: watched (twin/record.py)

    # -- what others ask --------------------------------------------------------------------------

    def watch(self) -> Any:
        """The Rust side of the last reading's watch (``plusequals._rust.Watch``), or None when the
        source must be read again first."""
        return None if self.reading is None else self.reading.watch.rust

    def replaced(self) -> List[str]:
        """The submodules replaced on the twin and not on the source, whose forward would run the others."""
        theirs = self.source._modules
        return [n for n in CHILDREN if self.modules.get(n) is not theirs.get(n)]

    # -- taking over the source -------------------------------------------------------------------

    def take_submodules(self) -> None:
        """Registers the source's six submodules on the twin, in the block's order (the same
        state_dict)."""
        source = self.source._modules
        for name in [n for n in source if n in CHILDREN] + [n for n in CHILDREN if n not in source]:
            self.modules[name] = source.get(name)

    def resume(self) -> None:
        """Follows the source as it is now (after the adoption, or in a copy): its submodules, and
        letting go before torch swaps a parameter (``block.double()`` with swapped parameters)."""
        self.kids = {name: self.source._modules.get(name) for name in CHILDREN}
        letgo.follow(self)

    def let_go(self) -> None:
        """Drops the Rust block and the reading: the twin reads the source and builds on the next call."""
        self.reading = None
        self._drop()

    # -- once per call --------------------------------------------------------------------------

    def stale(self) -> bool:
        """Whether the source must be read again: never read (a copy), refused, or the watch moved."""
        return self.reading is None or not self.reading.watch.unchanged()

    def read(self, error: type = UnsupportedBlockError, traced: bool = False) -> Reading:
        """Reads the source again, and answers the reading the twin computes with (its ``spec``,
        its ``weights()``). A submodule replaced on the source is taken over (one replaced on the
        twin is kept); a reason to refuse raises ``error``. ``traced``: at trace time (the
        parameters may be fake tensors), only what a traced call needs is kept, and the next
        eager call reads again."""
        source, modules = self.source, self.modules
        for name in CHILDREN:
            now = source._modules.get(name)
            if now is not self.kids.get(name):
                modules[name] = now
        self.kids = {name: source._modules.get(name) for name in CHILDREN}
        kids = {name: modules.get(name) for name in CHILDREN}
        reading = read_block(source, kids, modules=modules, trust=self.trust)
        if reading.reasons:
            self.reading = None
            raise error(
                f"{self.name}: the Rust block cannot reproduce this block exactly: {'; '.join(reading.reasons)}. "
                "It computes the SD v1 block (see plusequals.twin.faithful) and calls no submodule."
            )
        if reading.casting and not self.casts_layerwise:
            self.refuse(UnsupportedBlockError, _NO_CASTING)  # a ValueError too, as from_torch's
        self.lora_layers, self.casting = reading.lora_layers, bool(reading.casting)
        self.paths = reading.paths
        self.guards = [(obj, name, value, not isinstance(value, _SCALARS)) for obj, name, value in reading.watch.attrs]
        if traced:
            self.reading = None  # the next eager call reads again, on the real parameters
            return reading
        self.reading = reading
        reading.watch.add(self.ran)  # what the last checked run executed, from the values there now
        self.code_changes = code_changes(self.code_ok, reading.watch.code)
        self.probe_pending = bool(reading.unknown) or self.code_ok is None or bool(self.code_changes)
        return reading

    def rebuilt(self, weight: Tensor) -> None:
        """The twin built its Rust block again, on weights like ``weight``: proven in one dtype and
        on one device, the code is probed again in another."""
        self.probe_pending |= self._moved(weight)

    def check_code(
        self, forward: Any, config: BlockConfig, weight: Tensor, error: type = UnsupportedBlockError
    ) -> None:
        """Probes the source against the Rust block's ``forward`` (of configuration ``config``, on
        weights like ``weight``) where the reading asks for it (:meth:`_run_probe`); a refusal
        raises ``error``."""
        if self.probe_pending:
            self._run_probe(forward, config, weight, error)

    def refuse(self, error: type, why: str) -> None:
        """Raises ``error`` naming the twin, with the reading dropped: the next call reads again."""
        self.reading = None
        raise error(f"{self.name}: {why}")

    # -- the probe --------------------------------------------------------------------------------

    def _moved(self, weight: Tensor) -> bool:
        """Whether the block needs the probe after a rebuild: its classes are unknown, or the last
        proven run (its ATen ops: twin/probe.py) was in another dtype or on another device."""
        reading, ran = self.reading, self.ran
        if reading is None:
            return False
        proven = ran.ops if ran is not None else None
        return bool(reading.unknown) or proven is None or (proven.dtype, proven.device) != (weight.dtype, weight.device)

    def _run_probe(self, forward: Any, config: BlockConfig, weight: Tensor, error: type) -> None:
        """Runs the PyTorch block and the Rust block on one probe input (:func:`probe`) where it
        can: on the first reading, after the code the forward runs changed (a class patched, a
        module global replaced: ``Watch.code``), and for classes this crate does not know. Where
        the probe cannot run (meta), changed code is refused; the rest waits for a state
        where it can."""
        reading, changes = self.reading, self.code_changes
        shown = f"{', '.join(changes[:4])}{f' and {len(changes) - 4} more' if len(changes) > 4 else ''}"
        if not can_probe(weight):
            if changes:
                self.refuse(
                    error,
                    f"the code its forward runs changed since it was checked ({shown}), and no probe can check "
                    f"it in {weight.dtype} on {weight.device}",
                )
            return
        recorder = Recorder(reading.watch.functions, self.ran)  # what the PyTorch block runs: twin/record.py
        reason = probe(self.source, forward, config, weight, recorder.call)
        if reason:
            if reading.unknown:
                classes = ", ".join(reading.unknown)
                self.refuse(error, f"the block's classes ({classes}) are not ones this crate knows, and {reason}")
            elif changes:
                self.refuse(error, f"the code its forward runs changed since it was checked ({shown}), and {reason}")
            self.refuse(error, f"its forward's code (its classes and the globals they read): {reason}")
        self.probe_pending = False
        self.ran = recorder.ran or self.ran  # what it ran is watched from now on
        reading.watch.add(recorder.ran)
        self.code_ok = {n.label: n.value for n in reading.watch.code}
        self.code_changes = []

    # -- traced calls -----------------------------------------------------------------------------

    def check_traced(self, config: Any) -> None:
        """What a traced call of the twin (of configuration ``config``) checks after the structure
        check: the values the reading looked at (torch.compile guards on each), and the adapters
        that cannot run as the custom ops."""
        for obj, name, value, by_identity in self.guards:
            now = getattr(obj, name, None)
            if (now is not value) if by_identity else (now != value):
                raise UnsupportedBlockError(f"{self.name}: {type(obj).__name__}.{name} changed while traced")
        why = next(filter(None, (a.untraceable(config, self.casting, self.lora_layers) for a in ADAPTERS)), None)
        if why:
            raise UnsupportedBlockError(f"{self.name}: {why}")

    # -- copies -----------------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(reading=None, guards=[], kids={}, probe_pending=False, code_ok=None, code_changes=[], ran=None)
        return state
