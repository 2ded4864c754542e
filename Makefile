# Docs site from the notebooks (mkdocs-material + mkdocs-jupyter); see tools/build_docs.py.
#   make docs        the site into $(SITE_DIR)/ (open $(SITE_DIR)/index.html); a line per page as it converts, converted
#                    pages cached in build/docs-cache (the first build takes minutes, a rebuild seconds)
#   make serve-docs  build, then serve with live reload at http://127.0.0.1:$(DOCS_PORT)/
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python)
SITE_DIR ?= site
DOCS_PORT ?= 8008

.PHONY: docs serve-docs

docs:
	$(PYTHON) tools/build_docs.py --site-dir $(SITE_DIR)

serve-docs:
	$(PYTHON) tools/build_docs.py --site-dir $(SITE_DIR) --serve --port $(DOCS_PORT)
