# The README's commands. `make demo` and `make test` each create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Exact local pins (this machine has them on disk); pyproject.toml stays loose for GPU images.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

DEMO_DATA := data/demo
QUICK_DATA := data/demo-quick
WEB_DATA := data/demo-web
TEACHER_DATA := data/teacher
TEACHER := $(TEACHER_DATA)/model.pt

.PHONY: install demo demo-full demo-web teacher test test-fast lint bench schemas clean browser

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PINS)
	$(BIN)/python -m pip install --quiet -e '.[cpu,dev]' $(TORCH_PINS)
	touch $(STAMP)

# val/ is the newest part of the corpus: an older corpus without it is written anew.
$(DEMO_DATA)/val/ground_truth.parquet: | $(STAMP)
	$(BIN)/ncl-pipeline make-corpus --out $(DEMO_DATA) --samples 4000 --noise 0.4 \
		--partial 0.1 --seed 0 --samples-per-shard 500 --test-samples 500 --val-samples 500 \
		--corrupt 0.005

# The quick first demo: 2,000 pairs, a few minutes on 2 CPU cores (jobs/demo.yaml).
$(QUICK_DATA)/val/ground_truth.parquet: | $(STAMP)
	$(BIN)/ncl-pipeline make-corpus --out $(QUICK_DATA) --samples 2000 --noise 0.4 \
		--partial 0.1 --seed 0 --samples-per-shard 500 --test-samples 500 --val-samples 250 \
		--corrupt 0.005

demo: $(STAMP) $(QUICK_DATA)/val/ground_truth.parquet
	$(BIN)/ncl-pipeline run jobs/demo.yaml

# The full demo whose figures the README reports (jobs/demo-full.yaml, about 10 minutes).
demo-full: $(STAMP) $(DEMO_DATA)/val/ground_truth.parquet
	$(BIN)/ncl-pipeline run jobs/demo-full.yaml

# The teacher: a CLIP pretrained once on a clean corpus of another distribution whose captions
# name the object only (shape and colour: never size, background, count or position;
# jobs/teacher.yaml); the web demo starts from it and the selection benchmark scores with it.
$(TEACHER_DATA)/val/ground_truth.parquet: | $(STAMP)
	$(BIN)/ncl-pipeline make-corpus --noise-model teacher --out $(TEACHER_DATA) --samples 4000 \
		--seed 1000 --samples-per-shard 500 --test-samples 500 --val-samples 500 \
		--teacher-names shape,colour

$(TEACHER): $(TEACHER_DATA)/val/ground_truth.parquet jobs/teacher.yaml | $(STAMP)
	$(BIN)/ncl-pipeline run jobs/teacher.yaml
	cp runs/teacher/rounds/0/checkpoints/A/model.pt $@.tmp && mv $@.tmp $@

teacher: $(STAMP) $(TEACHER)

# Web-like noise (docs/corpus.md): page swaps, boilerplate, page captions, duplicates, clutter.
$(WEB_DATA)/val/ground_truth.parquet: | $(STAMP)
	$(BIN)/ncl-pipeline make-corpus --noise-model web --out $(WEB_DATA) --samples 2000 --seed 0 \
		--samples-per-shard 500 --test-samples 500 --val-samples 500

# Co-teaching from the teacher on the web corpus (jobs/demo-web.yaml); baselines with --set.
demo-web: $(STAMP) $(TEACHER) $(WEB_DATA)/val/ground_truth.parquet
	$(BIN)/ncl-pipeline run jobs/demo-web.yaml

# The report's browser test needs Chromium (Debian's package); installed when missing and root.
browser:
	@(command -v chromium && command -v chromedriver) >/dev/null || test "$$(id -u)" != 0 || \
		(apt-get update -qq && \
		 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)

test: $(STAMP) browser
	$(BIN)/python -m pytest

test-fast: $(STAMP) browser
	$(BIN)/python -m pytest -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check pipeline tests benchmarks
	$(BIN)/mypy --cache-dir $(VENV)/.mypy_cache

bench: $(STAMP) $(DEMO_DATA)/val/ground_truth.parquet
	$(BIN)/python benchmarks/embed.py

schemas: $(STAMP)
	$(BIN)/ncl-pipeline schemas --out schemas

clean:
	rm -rf runs/demo runs/demo-full runs/demo-web runs/teacher
