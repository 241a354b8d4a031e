"""Stub for the extension module built from rust/python.rs (PyO3 glue over rust/block.rs)."""

from typing import List, Mapping, Optional, Tuple

from torch import Tensor

TCH_VERSION: str
RUSTC_VERSION: str

class Block:
    def __init__(
        self,
        weights: Mapping[str, Tensor],
        *,
        dim: int,
        n_heads: int,
        d_head: int,
        context_dim: Optional[int] = None,
        gated_ff: bool = True,
        attention: str = "sdpa",
        language: str = "rust",
    ) -> None: ...
    def forward(self, x: Tensor, context: Optional[Tensor] = None) -> Tensor: ...
    def forward_owned(self, x: Tensor, context: Optional[Tensor] = None, donate: bool = False) -> Tensor: ...
    def echo(self, x: Tensor, context: Optional[Tensor] = None) -> Tensor: ...
    def donation_check(self, x: Tensor, context: Optional[Tensor] = None) -> None: ...
    def forward_loop(self, x: Tensor, context: Optional[Tensor] = None, n: int = 1, owned: bool = False) -> Tensor: ...

def alias_routes() -> List[Tuple[str, str]]: ...
def cpp_gallery() -> List[Tuple[str, bool, str]]: ...
