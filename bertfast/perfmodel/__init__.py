"""bertfast.perfmodel: H100 speed predicted from the compiled kernels, without a GPU (`bertfast perf-model`).

sass (read cuobjdump's listing: instructions, classes, the main loop), hardware (the H100's
constants and their sources), model (a launch's bounds and predicted time), kernels (which
launches, compiled offline at BERT's shapes, and what work each does), step (a pre-training step's
budget), report (targets, the comparison with a committed GPU run, the command).
docs/perf-model.md says how it works and how a GPU run calibrates it.
"""
