"""Clusters, the device spec table, VirtualDevice generation and mesh construction."""
