"""Thin scripts, run from the repository root as modules: python -m launch.NAME (harness code lives in nshard)."""
