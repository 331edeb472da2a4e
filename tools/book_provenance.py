"""Sphinx extension of the book: where each page's outputs came from, under its title.

Every notebook stores the outputs of its last execution together with the machine they came
from (metadata ``rerope_run``, written by ``tools/execute_notebooks.py``). This extension puts
that line at the top of the rendered page, right under the title::

    Outputs on this page: NVIDIA H200, torch 2.11.0+cu130, Triton 3.6.0 (executed 2026-11-29).

as a paragraph of class ``rerope-run`` (tests/test_site.py checks it against the metadata).
Enabled in _config.yml (``sphinx.local_extensions``); pages that are not notebooks, or
notebooks without the metadata, are left alone.
"""

import json
from pathlib import Path

from docutils import nodes

CSS_CLASS = "rerope-run"


def provenance_text(run):
    """The sentence shown for a notebook's ``rerope_run`` metadata."""
    date = str(run.get("date") or "")[:10]
    when = f" (executed {date})" if date else ""
    return (f"Outputs on this page: {run.get('device', 'unknown device')}, torch "
            f"{run.get('torch', '?')}, Triton {run.get('triton', '?')}{when}.")


def _insert_provenance(app, doctree):
    path = Path(app.env.doc2path(app.env.docname))
    if path.suffix != ".ipynb":
        return
    run = json.loads(path.read_text(encoding="utf-8")).get("metadata", {}).get("rerope_run")
    section = next(iter(doctree.findall(nodes.section)), None)
    if not isinstance(run, dict) or section is None:
        return
    paragraph = nodes.paragraph(classes=[CSS_CLASS])
    paragraph += nodes.emphasis(text=provenance_text(run))
    title = section.first_child_matching_class(nodes.title)
    section.insert(0 if title is None else title + 1, paragraph)


def setup(app):
    app.connect("doctree-read", _insert_provenance)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
