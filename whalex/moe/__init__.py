"""Mixture-of-Experts and expert parallelism: not built yet (issue 5). Nothing here is importable API."""
