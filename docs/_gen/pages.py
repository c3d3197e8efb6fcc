"""mkdocs-gen-files script: the pages generated from the code at build time (the config
reference). The support matrix is committed instead (docs/_gen/matrix.py), so a changed
refusal shows in review."""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import config_reference  # noqa: E402

with mkdocs_gen_files.open("reference/config.md", "w") as f:
    f.write(config_reference())
mkdocs_gen_files.set_edit_path("reference/config.md", "_gen/reference.py")
