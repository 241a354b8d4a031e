"""What the audit and the benchmarks are run on, shared by the CLI, the report, the guide's tables
and the tests: the project's own cases (:mod:`.project`: the seven residual strategies where the
seed's ``+=`` broke them, diffusers' UNet with and without it, real models on the meta device), the
seed's bugs under ``torch.compile`` (:mod:`.compiled`), real bugs from public issues (:mod:`.corpus`)
and the false-positive sweep over popular models (:mod:`.sweep`).

Their models are user code to :mod:`plusequals.auditing`, which imports nothing of this package.
"""
