"""The benchmark report, in pipeline order: measure -> analyse -> render.

Measuring (each module imports only those above it):

* :mod:`.timing`: the timer: interleaved, paired rounds on torch.utils.benchmark; median and
  quartiles (``Spread``); knows nothing of the block.
* :mod:`.setup`: what a cell measures on: the SD v1 shapes, a block and its inputs (``Setup``),
  the work of a call, the device's ceilings, peak memory, host time, torch.profiler's view.
* :mod:`.variants`: every implementation of the block behind one interface (``Variant``):
  PyTorch eager, Rust, C++, CUDA graphs, torch.compile; their probes in rounds.
* :mod:`.compilers`: the JAX and ONNX Runtime variants, and which of them writes in place.
* :mod:`.unet`: a whole diffusers UNet step, eager, with Rust blocks and compiled.
* :mod:`.audit_cost`: what ``plusequals.audit`` costs on a train step of each model family (a CNN, a
  ViT, a MobileNetV3, a transformer LM), beside anomaly mode.
* :mod:`.measure`: the run over every cell, the host-cost cell, the UNet step and the audit's cost, writing
  results.json as it goes.

Both sides:

* :mod:`.results`: results.json as typed rows, its I/O, and the number format.

Analysing and rendering (from results.json alone):

* :mod:`.analyse`: paired ratios, drift, per-step totals, targets; the verdicts' comparisons.
* :mod:`.render`: REPORT.md and the plots.

``python -m plusequals report`` (:mod:`plusequals.cli.report`) runs the three in turn.
"""
