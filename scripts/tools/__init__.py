"""Maintainer tools: run each as `python -m scripts.tools.<tool>` from the repository root (README.md here)."""
