"""Profiling (FLOPs, memory) and, later, hardware-aware balancing (Algorithm 1)."""
