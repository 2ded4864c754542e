# Docs site from the notebooks (mkdocs-material + mkdocs-jupyter); see tools/build_docs.py.
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python)
SITE_DIR ?= site
DOCS_PORT ?= 8008

.PHONY: docs serve-docs

docs:
	$(PYTHON) tools/build_docs.py --site-dir $(SITE_DIR)

serve-docs:
	$(PYTHON) tools/build_docs.py --site-dir $(SITE_DIR) --serve --port $(DOCS_PORT)
