# The README's commands. Each one sets up what it needs first, so both work on a fresh machine.
PYTHON ?= python3
# On these machines torch==2.13.0 resolves to a local CPU build; on a GPU machine pass a CUDA build,
# e.g. `make test TORCH_SPEC="torch>=2.4"`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# `make test` runs the tests on every core, at most 8 (pytest-xdist workers; tests/conftest.py shares the
# cores' threads out among them); PYTEST_JOBS=0 runs them in one process.
PYTEST_JOBS ?= auto

.PHONY: install install-demo demo test gpu-plan gpu-check gpu-check-dry gpu-loan gpu-land gpu-sizing compile-report perf-model bench info

# Everything, the test extras included (onnxruntime, sentence-transformers, peft ...: a few GB).
install:
	@echo "[make] installing $(TORCH_SPEC) and bertfast with its test extras (a few minutes on a fresh machine)"
	$(PYTHON) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYTHON) -m pip install --quiet -e ".[test]"

# Only what the demo runs (torch, transformers, tokenizers, matplotlib), and nothing when it is there.
install-demo:
	@if $(PYTHON) -c "import bertfast.kernels, torch, transformers, tokenizers, matplotlib" 2>/dev/null; then \
		echo "[make] bertfast and what the demo needs are installed"; \
	else \
		echo "[make] installing $(TORCH_SPEC) and bertfast[train] (a minute or two on a fresh machine)"; \
		$(PYTHON) -m pip install --quiet "$(TORCH_SPEC)" && $(PYTHON) -m pip install --quiet -e ".[train]"; \
	fi

# The main job: a short pre-training run of a small BERT on the embedded corpus with the fast
# kernels, printing loss, throughput and a parity check against the reference.
demo: install-demo
	$(PYTHON) -m bertfast.cli pretrain --demo

test: install
	$(PYTHON) -m pytest -q -n $(PYTEST_JOBS) --maxprocesses 8 $(PYTEST_ARGS)

# The GPU check, staged to fit GPU machines lent for 15 minutes (commands of <= 10 minutes).
# `make gpu-plan` prints the stages with their estimated minutes; `make gpu-check` runs them all,
# `make gpu-check STAGE=k` one; logs, results and caches go to $(GPU_OUT). On the GPU machine
# (torch/triton/transformers preinstalled, no network) nothing else is needed: stage 1 installs.
# `make gpu-land GPU_OUT=dir` (back here) files a GPU run under benchmarks/results/ and
# regenerates the README's result table. `make gpu-check-dry` runs every stage on CPU;
# SIMULATE="fail:build lost-machine" (or hang:STEP, crash:STEP) simulates failures there.
GPU_OUT ?= gpu-out
STAGE ?=

gpu-plan:
	$(PYTHON) -m bertfast.gpucheck plan --out $(GPU_OUT)

gpu-check:
	$(PYTHON) -m bertfast.gpucheck run --out $(GPU_OUT) $(if $(STAGE),--stage $(STAGE))

# A 15-minute loan: PART=1 (build, sanitizers beside the tests), then at once PART=2 (headline, profile,
# what fits of stages 4-5) on the still-warm machine; BUNDLE gets gpu-run.tgz (logs, no caches).
PART ?= 1
BUNDLE ?= $(GPU_OUT)
gpu-loan:
	PYTHON=$(PYTHON) scripts/gpu-loan.sh $(PART) $(GPU_OUT) $(BUNDLE)

SIMULATE ?=
gpu-check-dry:
	$(PYTHON) -m bertfast.gpucheck run --dry-run --out $(GPU_OUT)-dry $(if $(STAGE),--stage $(STAGE)) \
		$(foreach s,$(SIMULATE),--simulate $(s))

gpu-land:
	$(PYTHON) -m bertfast.gpucheck land $(GPU_OUT)

# Re-measure what the GPU check's limits are sized from (import and compile times, candidates per
# case; a few minutes on CPU, nvcc needed) into bertfast/gpucheck/measured.json.
gpu-sizing:
	$(PYTHON) -m bertfast.gpucheck.sizing --measure

# Registers, spills and shared memory of every kernel and autotune candidate on sm_90, no GPU
# needed; fails when a candidate spills. COMPILE_REPORT_ARGS=--fast: the training configuration.
COMPILE_REPORT_ARGS ?=
compile-report:
	$(PYTHON) -m bertfast.gpucheck.compile_report $(COMPILE_REPORT_ARGS)

# H100 speed predicted from the kernels' sm_90 SASS against the targets, beside the latest committed
# GPU run (docs/perf-model.md); no GPU needed, about 3 minutes. PERF_MODEL_ARGS="--json FILE" keeps it all.
PERF_MODEL_ARGS ?=
perf-model:
	env -u TRITON_INTERPRET $(PYTHON) -m bertfast.cli perf-model $(PERF_MODEL_ARGS)

bench:
	$(PYTHON) -m bertfast.cli bench --quick

info:
	$(PYTHON) -m bertfast.cli info
