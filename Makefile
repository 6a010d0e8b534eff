# The README's commands. Each one sets up what it needs first, so both work on a fresh machine.
PYTHON ?= python3
# On these machines torch==2.13.0 resolves to a local CPU build; on a GPU machine pass a CUDA build,
# e.g. `make test TORCH_SPEC="torch>=2.4"`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test gpu-check bench info

install:
	$(PYTHON) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYTHON) -m pip install --quiet -e ".[test]"

# The main job: a short pre-training run of a small BERT on the embedded corpus with the fast
# kernels, printing loss, throughput and a parity check against the reference.
demo: install
	$(PYTHON) -m bertfast.cli pretrain --demo

test: install
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

# With a GPU at hand: every GPU-marked test, then the full benchmark run into benchmarks/results/.
# On a machine whose torch/triton/transformers are already installed and that has no network:
#   pip install --no-deps --no-build-isolation -e . && make gpu-check
gpu-check:
	$(PYTHON) -m pytest -q -m gpu tests $(PYTEST_ARGS)
	$(PYTHON) -m bertfast.cli bench --suite all   # writes benchmarks/results/<gpu>/<date>/

bench:
	$(PYTHON) -m bertfast.cli bench --quick

info:
	$(PYTHON) -m bertfast.cli info
