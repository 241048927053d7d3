# gridtron: `make train` and `make test` work on a fresh clone (they create .venv when missing).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 8
TORCHRUN := $(VENV)/bin/torchrun

.PHONY: train train-serial test bench device-check clean

# pip compiles the installed modules one file at a time; compileall does the same work on every core
# (30 s less here). The bytecode is a cache: a file neither can compile (torch ships one written for
# Python 3.12) is left to the interpreter, as pip leaves it, hence the `|| true`.
$(STAMP): requirements-cpu.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	touch $(STAMP)

# The main job: 3D-parallel GPT pretraining (tp=2, pp=2, dp=2) on the built-in corpus, 8 CPU processes.
# --overwrite: a repeated `make train` replaces the previous one's finished run in runs/3d.
train: $(STAMP)
	$(TORCHRUN) --standalone --nproc-per-node $(NPROC) -m engine.train --config configs/train_3d.yaml --overwrite
	$(PY) -m engine.generate --load runs/3d/checkpoints --prompt "def main(" --max-new-tokens 64

# The same recipe in one process (tp=pp=dp=1).
train-serial: $(STAMP)
	$(PY) -m engine.train --config configs/train_3d.yaml --tp 1 --pp 1 --run-dir runs/serial --overwrite

# Two pytest workers, one test file each at a time (module fixtures and rank pools stay per file),
# in the order tests/conftest.py sets (heaviest first: no reordering by test count); TEST_WORKERS=0
# runs in this process.
TEST_WORKERS ?= 2

# The sources compiled once first: with PYTHONDONTWRITEBYTECODE set (as on CI) every process the
# suite starts would otherwise compile the engine's modules again (half a second each).
test: $(STAMP)
	$(PY) -m compileall -q engine models parallel kernels benchmarks tests
	$(PY) -m pytest tests -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

bench: $(STAMP)
	$(PY) -m benchmarks.peers.overhead
	$(PY) -m benchmarks.communication.scaling

# On a CUDA or Ascend NPU machine: kernel paths against their references, then a 1.3B GPT eager, an
# MoE GPT against its dense twin, the 1.3B GPT compiled, and the optional stages if time remains,
# within 9 minutes. It runs on the current
# Python when its torch sees a device (no .venv needed there), else in .venv ("nothing to check").
HAS_DEVICE := import importlib.util as u, torch; npu = u.find_spec("torch_npu") is not None and __import__("torch_npu") and torch.npu.is_available(); raise SystemExit(0 if (torch.cuda.is_available() or npu) else 1)
device-check:
	@if $(PYTHON) -c '$(HAS_DEVICE)' 2>/dev/null; then \
		PYTHONPATH=. $(PYTHON) -m benchmarks.device_check --out runs/device_check; \
	else \
		$(MAKE) --no-print-directory $(STAMP) && $(PY) -m benchmarks.device_check --out runs/device_check; \
	fi

clean:
	rm -rf runs .pytest_cache
