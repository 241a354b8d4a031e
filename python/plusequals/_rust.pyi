"""Stub for the extension module ``plusequals._rust``, built from rust/python/ (the PyO3 code; mod.rs
declares the module) over the crate (rust/block.rs and its neighbours).

Checked against the built module by mypy's stubtest (tests/test_architecture.py)."""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, final

from torch import Tensor

__all__ = [
    "Block",
    "Config",
    "DonationConsumed",
    "Entry",
    "OwnershipError",
    "RUSTC_VERSION",
    "StaleBlock",
    "TCH_VERSION",
    "UnsupportedBlockError",
    "UseAfterDonation",
    "Watch",
    "WeightsChanged",
    "_fail_next_forward_owned_at",
    "alias_routes",
    "cpp_gallery",
    "tensor_facts",
]

TCH_VERSION: str
RUSTC_VERSION: str

class OwnershipError(ValueError):
    def __init__(
        self, message: str, arg: str, why: str, count: Optional[int] = None, modes: Sequence[str] = ()
    ) -> None: ...
    @property
    def arg(self) -> str: ...
    @property
    def why(self) -> str: ...
    @property
    def count(self) -> Optional[int]: ...
    @property
    def modes(self) -> List[str]: ...

class UnsupportedBlockError(ValueError): ...
class StaleBlock(ValueError): ...
class WeightsChanged(RuntimeError): ...
class DonationConsumed(RuntimeError): ...

class UseAfterDonation(DonationConsumed):
    def __init__(self, message: str, op: str) -> None: ...
    @property
    def op(self) -> str: ...

@final
class Watch:
    def __new__(
        cls,
        same: List[Tuple[Dict[Any, Any], Any, Any]],
        classes: List[Tuple[Any, type]],
        sizes: List[Tuple[Dict[Any, Any], int]],
        empty: List[Dict[Any, Any]],
        keys: List[Tuple[Dict[Any, Any], List[Any]]],
        lists: List[Tuple[List[Any], List[Any]]] = ...,
        functions: List[Any] = ...,
        holders: List[Tuple[Any, str, Any]] = ...,
        direct: bool = True,
    ) -> Watch: ...
    def unchanged(self) -> bool: ...
    # how many dicts the version-tag shortcut covers (0 where CPython keeps no tags)
    @property
    def tagged(self) -> int: ...
    # (function fields and cells compared in place, functions compared through getattr)
    @property
    def functions(self) -> Tuple[int, int]: ...
    # (other fields compared in place: classes' MROs, instances' dicts, partials' fields; compared through getattr)
    @property
    def fields(self) -> Tuple[int, int]: ...

@final
class Entry:
    def __new__(cls, block: Block, watch: Optional[Watch] = None) -> Entry: ...
    @property
    def block(self) -> Block: ...
    @property
    def watch(self) -> Optional[Watch]: ...
    # a Tensor, or NotImplemented where Python code could see the call (RustBlock's full path)
    def forward(self, x: Tensor, context: Optional[Tensor] = None) -> Any: ...
    def forward_owned(self, x: Tensor, context: Optional[Tensor] = None, donate: bool = False) -> Any: ...

@final
class Config:
    def __new__(
        cls,
        *,
        dim: int,
        n_heads: int,
        d_head: int,
        context_dim: Optional[int] = None,
        gated_ff: bool = True,
        attention: str = "sdpa",
        language: str = "rust",
        lora: Sequence[Tuple[str, int, float, bool, bool]] = ...,
        ip_adapter: Sequence[float] = ...,
        processors: Sequence[Tuple[str, str, Sequence[str]]] = ...,
    ) -> Config: ...
    def weight_keys(self) -> List[str]: ...
    def cpp_refusal(self) -> Optional[str]: ...

@final
class Block:
    def __new__(cls, weights: Mapping[str, Tensor], config: Config) -> Block: ...
    def forward(
        self,
        x: Tensor,
        context: Optional[Tensor] = None,
        watch: Optional[Watch] = None,
        attention_mask: Optional[Tensor] = None,
        encoder_attention_mask: Optional[Tensor] = None,
        ip_adapter: Sequence[Tensor] = ...,
    ) -> Tensor: ...
    def forward_owned(
        self,
        x: Tensor,
        context: Optional[Tensor] = None,
        donate: bool = False,
        watch: Optional[Watch] = None,
        attention_mask: Optional[Tensor] = None,
        encoder_attention_mask: Optional[Tensor] = None,
    ) -> Tensor: ...
    def echo(self, x: Tensor, context: Optional[Tensor] = None) -> Tensor: ...
    def donation_check(self, x: Tensor, context: Optional[Tensor] = None) -> None: ...
    def forward_loop(
        self,
        x: Tensor,
        context: Optional[Tensor] = None,
        n: int = 1,
        owned: bool = False,
        watch: Optional[Watch] = None,
    ) -> Tensor: ...

def alias_routes() -> List[Tuple[str, str]]: ...
def cpp_gallery() -> List[Tuple[str, bool, str]]: ...
def tensor_facts(t: Tensor) -> Dict[str, Any]: ...

# Only in the test build (cargo feature `failpoints`: `make build-dev`), not in the wheel.
def _fail_next_forward_owned_at(step: Optional[str]) -> None: ...
