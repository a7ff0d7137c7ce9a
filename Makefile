# forge: the two commands.
#   make run   install what is missing, build (Release), train the default model, print a sample
#   make test  install what is missing, build, run the whole test suite through CTest
BUILD ?= build
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release
RUN_ARGS ?=

.PHONY: all deps deps-bench configure build build-cli run run-multimodal run-finetune test bench clean

all: build

deps:
	@bash scripts/install-deps.sh

deps-bench:
	@bash scripts/install-deps.sh --bench

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS)

configure: deps $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD)

# Only the forge command and the library under it: what `make run` needs (no tests, no benchmarks).
build-cli: configure
	cmake --build $(BUILD) --target forge_cli

# The demo starts over each time (checkpoint.overwrite): its previous run's checkpoints in runs/default go.
run: build-cli
	$(BUILD)/bin/forge train --config configs/default.toml --set checkpoint.overwrite=true $(RUN_ARGS)

# The tiny multimodal job: forge renders 6000 captioned 32x32 images of shapes (once, and again when the
# generator version in data/shapes/synth.json is not the current one), then a LLaVA learns to
# caption them (about 2 minutes), then reports its held-out caption loss and how many of the 600 held-out
# images it captions exactly right (configs/llava-tiny.toml; docs/multimodal.md).
run-multimodal: build-cli
	@grep -qs '"version": 2' data/shapes/synth.json || $(BUILD)/bin/forge data synth-images --out data/shapes --count 6000 --size 32
	$(BUILD)/bin/forge train --config configs/llava-tiny.toml --set checkpoint.overwrite=true $(RUN_ARGS)

# The fine-tuning job: the default job's model (trained first when runs/default has no checkpoint) learns to
# name the book of a KJV verse from questions forge writes (data/kjv-qa), packed with document masks, then
# answers the held-out questions (configs/finetune-kjv.toml; docs/fine-tuning.md).
run-finetune: build-cli
	@test -d runs/default/checkpoint || $(BUILD)/bin/forge train --config configs/default.toml --set checkpoint.overwrite=true
	@test -s data/kjv-qa/train.jsonl || $(BUILD)/bin/forge data synth-qa --out data/kjv-qa
	$(BUILD)/bin/forge train --config configs/finetune-kjv.toml --set checkpoint.overwrite=true $(RUN_ARGS)

test: build
	# One test at a time: each test already uses every core through OpenMP, and two at once make
	# OpenMP barriers spin against each other (100x slower on 2 cores).
	cd $(BUILD) && ctest --output-on-failure --timeout 600

bench: deps-bench build
	bash bench/run_all.sh $(BUILD)

clean:
	rm -rf $(BUILD)
