"""The block itself: the PyTorch ``BasicTransformerBlock`` and its residual strategies
(:mod:`.blocks`), the bugs they reproduce (:mod:`.bugs`), and its twins in other frameworks that
need no Rust: JAX (:mod:`.jax_block`) and ONNX Runtime (:mod:`.onnx_block`)."""
