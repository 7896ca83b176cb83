"""Capture into TaskGraphs, sharding patterns and bridges, and emission of the jitted step."""
