"""The bridge to the Rust and C++ twins: what a tensor becomes when donated (:mod:`.donated`),
what the Rust block reproduces exactly (:mod:`.faithful`), the custom ops that torch.compile and
torch.export see (:mod:`.ops`), ``RustBlock`` and ``CppBlock`` (:mod:`.block`), the diffusers
drop-in (:mod:`.swap`) and the alias catalogue (:mod:`.aliases`)."""
