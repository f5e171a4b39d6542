"""Sphinx configuration (EN); sources are Markdown read through MyST."""

project = "lightllm"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
master_doc = "index"
language = "en"
html_theme = "alabaster"
exclude_patterns = ["_build"]
