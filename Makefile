# Two commands on a fresh machine: `make run` (daemon on a real model) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
GENIE  := $(VENV)/bin/genie-supervisor
STAMP  := $(VENV)/.installed
APT_GET := $(shell command -v apt-get 2>/dev/null)

.PHONY: run test check format deps system-deps models ui-assets lint bench bench-engine bench-gate bench-voice bench-soak clean

$(STAMP): pyproject.toml
	@$(PY) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv $(VENV) || { \
	  echo "venv failed (Debian splits it out): installing python3-venv"; \
	  apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv --clear $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

deps: $(STAMP) ui-assets

# The web page's charting library (uPlot, pinned, sha512-checked) from the npm registry into the git-ignored
# genie_supervisor/ui/static/vendor/ (shipped in wheels). Without it the page works and says charts are off.
ui-assets: $(STAMP)
	@$(PY) -m genie_supervisor.ui.vendor || echo "ui-assets: the page's charts stay unavailable (see above)"

# Mosquitto is a real part of the tests (MQTT); gcc builds the native CPU kernels at first use
# (engine/kernels/cpu/, cached under ~/.cache/genie-supervisor/kernels); g++ builds the GPU kernels'
# dot products for the host (tests/qdot_host.py); chromium runs the web page's tests (headless,
# driven by Playwright). Installed from Debian when missing; without them the MQTT, host-kernel
# and page tests skip (fail under CI=true) and the engine falls back to pure NumPy.
system-deps:
	@missing=""; \
	command -v mosquitto >/dev/null 2>&1 || test -x /usr/sbin/mosquitto || missing="$$missing mosquitto"; \
	command -v cc >/dev/null 2>&1 || missing="$$missing gcc libc6-dev"; \
	command -v c++ >/dev/null 2>&1 || missing="$$missing g++"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  if [ -n "$(APT_GET)" ]; then echo "installing$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "not found and apt-get unavailable:$$missing"; fi; fi

models: $(STAMP)
	@$(GENIE) models fetch smollm2 >/dev/null
	@$(GENIE) models fetch gemma3 >/dev/null

run: $(STAMP) system-deps ui-assets
	$(GENIE) run --model "$$($(GENIE) models fetch smollm2)" --policy policies/default.yaml

test: $(STAMP) system-deps models ui-assets
	$(PY) -m pytest -q tests

# What CI runs (.ci/run): lint (ruff), the format check (ruff format), types (mypy, strict on
# engine/ and genie_supervisor/, see pyproject.toml) and the tests.
check: lint test

lint: $(STAMP)
	$(VENV)/bin/ruff check genie_supervisor engine tests bench
	$(VENV)/bin/ruff format --check genie_supervisor engine tests bench
	$(VENV)/bin/mypy genie_supervisor engine

format: $(STAMP)
	$(VENV)/bin/ruff format genie_supervisor engine tests bench
	$(VENV)/bin/ruff check --fix --select I genie_supervisor engine tests bench

bench-engine: $(STAMP) models
	$(PY) -m bench.engine_cpu

bench-gate: $(STAMP) models
	$(PY) -m bench.gate

# Voice path under LLM load on a real voice stack (wyoming-faster-whisper + wyoming-piper from PyPI,
# installed on first use into their own venv under ~/.cache/genie-supervisor/voice, outside the
# repo). ~12 minutes on 2 cores; results in bench/results/voice_path-<date>/. See docs/benchmarks.md.
# Extra arguments: make bench-voice VOICE_ARGS="--rounds 3"
bench-voice: $(STAMP) models
	$(PY) -m bench.voice_path $(VOICE_ARGS)

# Soak: 2,000 mixed operations against the real daemon (SmolLM2 + Gemma-3, Mosquitto); RSS/FD slopes,
# decode-speed deciles, slots at the end. ~25-30 min on 2 cores; results in bench/results/soak-<date>/.
# Extra arguments: make bench-soak SOAK_ARGS="--requests 5000"
bench-soak: $(STAMP) system-deps models
	$(PY) -m bench.soak $(SOAK_ARGS)

bench: bench-engine bench-gate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
