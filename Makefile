# Targets for a fresh Debian machine with python3:
#   make book   set up .venv, then build the HTML book (_build/html); any warning fails it
#   make test   make book, install Debian's chromium + chromedriver when missing, then run the
#               unit tests, the notebooks (nbval) and the rendered-site test in one pytest run
#   make test-floor  the oldest supported Triton (kernels/rerope/_compat.py) in a venv of its own,
#               .venv-floor: the sm_75/80/89/90 cross-compile, a few interpreter cases; then
#               Triton 3.6 in front of it: the Gluon kernels' sm_90 cross-compile
#   make lab    the .venv plus JupyterLab (requirements-lab.txt, not part of make test), then
#               `jupyter lab book/`: the notebooks, opened locally
# Setup runs once: .venv/.setup-stamp records it, and it reruns only when requirements.txt or
# requirements-nodeps.txt changes. Override e.g. `make test PYTHON=python3.12 TORCH=torch==2.11.0`;
# on a machine without the local CPU wheel, take torch from another index, e.g.
#   make test TORCH=torch TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   make test-install   build the wheel, install it with the newest transformers into a fresh
#               venv (.venv-install) and run tools/smoke_install.py from outside the checkout

PYTHON ?= python3
# On the project's CPU machines torch==2.13.0 is a CPU wheel on local disk. It is installed
# before requirements.txt so that the open torch range there never pulls a CUDA build.
TORCH  ?= torch==2.13.0
# An index for torch alone (empty: pip's configured one), e.g. PyTorch's CPU index.
TORCH_INDEX ?=
VENV   ?= .venv

BIN   := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
SUDO  := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PIP   := $(BIN)/python -m pip --disable-pip-version-check install --progress-bar off
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)

JB_FLAGS     ?= --all --warningiserror --keep-going
PYTEST_FLAGS ?=
# `make test` spreads the test files over up to 4 processes (pytest-xdist; one file stays in
# one process, so a notebook's cells run in order in one kernel): on CI's two cores about half
# the time of one process. PYTEST_PARALLEL= runs everything in one process.
PYTEST_PARALLEL ?= -n auto --maxprocesses 4 --dist loadfile

# The floor job's venv: the oldest Triton the package supports (kernels/rerope/_compat.py, stated in
# requirements.txt and README.md; tests/test_versions.py checks that all of them agree), numpy
# below 2.4 (Triton < 3.7's interpreter needs it), the same CPU torch and pytest: nothing else.
FLOOR_VENV   ?= .venv-floor
FLOOR_TRITON ?= triton==3.4.0
FLOOR_NUMPY  ?= numpy<2.4
FLOOR_BIN    := $(FLOOR_VENV)/bin
FLOOR_PINS   := "$(TORCH)" "$(FLOOR_TRITON)" "$(FLOOR_NUMPY)" pytest
GLUON_TRITON ?= triton==3.6.0
GLUON_TARGET ?= .gluon-triton

# The install job's venv: the wheel as a user installs it, beside the newest transformers.
INSTALL_VENV ?= .venv-install

.PHONY: book test test-floor test-install setup setup-floor browser clean lab

book: $(STAMP)
	$(BIN)/jupyter-book build $(JB_FLAGS) .

# pytest exits 5 when it collects no test at all; that is not a failure here.
test: book browser
	$(BIN)/python -m pytest tests book \
	    --nbval --nbval-current-env --nbval-sanitize-with book/sanitize.cfg $(PYTEST_PARALLEL) \
	    $(PYTEST_FLAGS); \
	rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): not a failure"; rc=0; fi; \
	exit $$rc

# The floor job: tests/test_versions.py (the version checks, a few forward + backward cases
# in the interpreter, a TMA-path compile for sm_90) and tests/test_compile.py (the riskiest
# configurations for sm_75/80/89/90): 2.5-5 minutes on two busy cores, plus 1.5 for a fresh
# venv. The warning filtered is numpy's about the very conversion that numpy 2.4 refuses (why
# numpy stays below 2.4 here), once per interpreted loop.
# Then, with Triton 3.6 (the Gluon API the Hopper kernels are written for) put in front of the
# floor's own Triton (pip --target into .gluon-triton, no other change to the venv):
# tests/test_hopper.py, whose sm_90 cross-compile of the Gluon kernels runs only there (under a
# minute, plus the wheel's download once).
test-floor: setup-floor
	$(FLOOR_BIN)/python -m pytest tests/test_versions.py tests/test_compile.py \
	    -W "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning" \
	    $(PYTEST_FLAGS)
	@[ -d $(GLUON_TARGET)/triton ] || $(FLOOR_BIN)/python -m pip --disable-pip-version-check \
	    install --progress-bar off --no-deps --target $(GLUON_TARGET) "$(GLUON_TRITON)"
	PYTHONPATH=$(CURDIR)/$(GLUON_TARGET) $(FLOOR_BIN)/python -m pytest tests/test_hopper.py \
	    $(PYTEST_FLAGS)

setup: $(STAMP)

# The package as users install it: build the wheel (library only), install it with its `hf`
# extra and the newest transformers into a fresh venv (torch first, as above), check
# `pip check`, then run the smoke test from a folder outside the checkout.
test-install:
	rm -rf $(INSTALL_VENV) dist build
	$(call make-venv,$(INSTALL_VENV))
	$(INSTALL_VENV)/bin/python -m pip --disable-pip-version-check install --progress-bar off \
	    $(TORCH_FROM) "$(TORCH)"
	$(INSTALL_VENV)/bin/python -m pip --disable-pip-version-check install --progress-bar off build
	$(INSTALL_VENV)/bin/python -m build --wheel --outdir dist .
	$(INSTALL_VENV)/bin/python -m pip --disable-pip-version-check install --progress-bar off \
	    "$$(ls dist/rerope_triton-*.whl)[hf]" transformers
	$(INSTALL_VENV)/bin/python -m pip --disable-pip-version-check check
	cd "$$(mktemp -d)" && cp $(CURDIR)/tools/smoke_install.py . && \
	    $(CURDIR)/$(INSTALL_VENV)/bin/python smoke_install.py

# JupyterLab only here: CI and `make test` never install it.
lab: $(STAMP)
	$(PIP) -r requirements-lab.txt
	$(BIN)/jupyter lab book/

# A venv at $(1), with Debian's python3-venv installed first when `python -m venv` fails.
define make-venv
	@if [ ! -x $(1)/bin/python ]; then \
	    $(PYTHON) -m venv $(1) || { \
	        echo "python venv failed; installing Debian's python3-venv"; \
	        rm -rf $(1); \
	        $(SUDO) apt-get update && \
	        $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv && \
	        $(PYTHON) -m venv $(1); }; \
	fi
endef

$(STAMP): requirements.txt requirements-nodeps.txt
	$(call make-venv,$(VENV))
	$(PIP) $(TORCH_FROM) "$(TORCH)"
	$(PIP) -r requirements.txt
	$(PIP) --no-deps -r requirements-nodeps.txt
	touch $@

# Reinstalls only when the pins change (the stamp holds them).
setup-floor:
	$(call make-venv,$(FLOOR_VENV))
	@if [ "$$(cat $(FLOOR_VENV)/.setup-stamp 2>/dev/null)" != '$(FLOOR_PINS)' ]; then \
	    $(FLOOR_BIN)/python -m pip --disable-pip-version-check install --progress-bar off \
	        $(TORCH_FROM) "$(TORCH)" && \
	    $(FLOOR_BIN)/python -m pip --disable-pip-version-check install --progress-bar off \
	        $(FLOOR_PINS) && \
	    echo '$(FLOOR_PINS)' > $(FLOOR_VENV)/.setup-stamp; \
	else echo '$(FLOOR_VENV) is set up: $(FLOOR_PINS)'; fi

browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
	    echo "chromium and chromedriver present"; \
	else \
	    $(SUDO) apt-get update && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; \
	fi

clean:
	rm -rf _build dist build
