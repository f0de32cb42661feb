"""Benchmarks and maintainer tools, not part of the installed package (pyproject.toml installs
cp_linattn and launch only). This file makes `python -m scripts.tools.<tool>` from the repository
root find this folder, whatever else is installed; see scripts/tools/README.md."""
