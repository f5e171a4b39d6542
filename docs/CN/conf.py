"""Sphinx configuration (CN); sources are Markdown read through MyST."""

project = "lightllm"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
# Pages link to each other's headings as `page.md#slug`; MyST resolves those only for headings
# it gives slugs to, and results.md goes down to H4.
myst_heading_anchors = 4
master_doc = "index"
language = "zh_CN"
html_theme = "alabaster"
exclude_patterns = ["_build"]
