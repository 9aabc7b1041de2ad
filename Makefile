# Stable Diffusion on TorchServe. `make serve` and `make test` do all the set-up they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEFAULT_MODEL_DIR := models/tiny-sd
MODEL_DIR ?= $(DEFAULT_MODEL_DIR)
ARCHIVE_FORMAT ?= auto
PYTEST_ARGS ?=

.PHONY: help venv system-deps model mar serve stop test unit-test integration-test dashboard dashboard-png loadtest sweep bench-overhead clean

help:
	@echo "make serve   set up, build the archive and serve it on 127.0.0.1:8080 (MODEL_DIR=/path for a real model)"
	@echo "make test    set up and run the whole test suite"
	@echo "make stop    stop a server started by make serve elsewhere"
	@echo "make mar     build model_store/stable-diffusion.mar (or a directory for large models)"
	@echo "make model   generate the default tiny model into $(DEFAULT_MODEL_DIR)"
	@echo "make loadtest       locust against the running server (make serve), judged against the SLA in benchmark_config.yaml"
	@echo "make sweep          batch size / delay / workers / concurrency sweep on its own server; report in reports/"
	@echo "make bench-overhead serving overhead: TorchServe end to end vs the pipeline in-process"
	@echo "make dashboard      rebuild docker/grafana/dashboards/stable-diffusion.json"
	@echo "make dashboard-png  load a fresh server, render the dashboard panels from Prometheus to docs/img/dashboard.png"

venv: $(VENV)/.installed

# torch first: torch==2.13.0 resolves to the local CPU build; then everything else, pinned.
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==26.3
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

# Prometheus and promtool (Debian package) for the observability tests.
system-deps:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y prometheus; }

model: $(DEFAULT_MODEL_DIR)/model_index.json

$(DEFAULT_MODEL_DIR)/model_index.json: scripts/make_tiny_model.py | $(VENV)/.installed
	$(PY) -m scripts.make_tiny_model $(DEFAULT_MODEL_DIR)

# build_mar.py skips the work when handler, config and weights are unchanged.
mar: venv $(if $(filter $(DEFAULT_MODEL_DIR),$(MODEL_DIR)),model)
	$(PY) -m scripts.build_mar --model-dir "$(MODEL_DIR)" --archive-format $(ARCHIVE_FORMAT)

serve: mar
	$(PY) -m scripts.server

stop:
	@if [ -f runtime/server.pid ]; then kill -TERM "$$(cat runtime/server.pid)" && echo "stop requested"; \
	else $(VENV)/bin/torchserve --stop; fi

test: venv model system-deps
	$(PY) -m pytest tests $(PYTEST_ARGS)

unit-test: venv model system-deps
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

integration-test: venv model system-deps
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

loadtest: venv
	$(PY) -m loadtest.run $(LOADTEST_ARGS)

sweep: venv model
	$(PY) -m loadtest.sweep $(SWEEP_ARGS)

bench-overhead: venv model
	$(PY) -m loadtest.overhead

dashboard: venv
	$(PY) -m scripts.build_dashboard

dashboard-png: venv model system-deps
	$(PY) -m scripts.render_dashboard --duration 120 --output docs/img/dashboard.png

clean:
	rm -rf model_store/*.mar model_store/stable-diffusion model_store/.*.fingerprint runtime build
