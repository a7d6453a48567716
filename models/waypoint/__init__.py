"""Waypoint: Overworld's frame-causal rectified-flow world model (``world_engine``), on ARStream's runner."""
