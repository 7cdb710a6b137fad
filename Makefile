# Shortcuts for the usual commands; each target runs the script or benchmark named beside it.
PYTHON ?= .venv/bin/python

.PHONY: help up test bench soak load load-worker

help:
	@echo "make up           run the system locally (scripts/run.sh)"
	@echo "make test         lint, type-check and run every test (scripts/test.sh)"
	@echo "make bench        the pipeline benchmark (bench/pipeline.py)"
	@echo "make soak         5,000 small jobs; Redis keys and memory before, at peak, after TTLs"
	@echo "make load         open-loop POST /v1/jobs at rising rates, no worker"
	@echo "make load-worker  the same with one CPU worker running"

up:
	scripts/run.sh

test:
	scripts/test.sh

bench:
	$(PYTHON) bench/pipeline.py

soak:
	$(PYTHON) bench/soak.py

load:
	$(PYTHON) bench/load.py

load-worker:
	$(PYTHON) bench/load.py --worker
