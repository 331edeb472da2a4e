# Two targets for a fresh Debian machine with python3:
#   make book   set up .venv, then build the HTML book (_build/html); any warning fails it
#   make test   make book, install Debian's chromium + chromedriver when missing, then run the
#               unit tests, the notebooks (nbval) and the rendered-site test in one pytest run
# Setup runs once: .venv/.setup-stamp records it, and it reruns only when requirements.txt
# changes. Override e.g. `make test PYTHON=python3.12 TORCH=torch==2.11.0`.

PYTHON ?= python3
# On the project's CPU machines torch==2.13.0 is a CPU wheel on local disk. It is installed
# before requirements.txt so that the open torch range there never pulls a CUDA build.
TORCH  ?= torch==2.13.0
VENV   ?= .venv

BIN   := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
SUDO  := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PIP   := $(BIN)/python -m pip --disable-pip-version-check install --progress-bar off

JB_FLAGS     ?= --all --warningiserror --keep-going
PYTEST_FLAGS ?=

.PHONY: book test setup browser clean

book: $(STAMP)
	$(BIN)/jupyter-book build $(JB_FLAGS) .

# pytest exits 5 when it collects no test at all; that is not a failure here.
test: book browser
	$(BIN)/python -m pytest tests book \
	    --nbval --nbval-current-env --nbval-sanitize-with book/sanitize.cfg $(PYTEST_FLAGS); \
	rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): not a failure"; rc=0; fi; \
	exit $$rc

setup: $(STAMP)

$(STAMP): requirements.txt
	@if [ ! -x $(BIN)/python ]; then \
	    $(PYTHON) -m venv $(VENV) || { \
	        echo "python venv failed; installing Debian's python3-venv"; \
	        rm -rf $(VENV); \
	        $(SUDO) apt-get update && \
	        $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv && \
	        $(PYTHON) -m venv $(VENV); }; \
	fi
	$(PIP) "$(TORCH)"
	$(PIP) -r requirements.txt
	touch $@

browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
	    echo "chromium and chromedriver present"; \
	else \
	    $(SUDO) apt-get update && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; \
	fi

clean:
	rm -rf _build
