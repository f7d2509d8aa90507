"""The attention primitives: forward, its tangent map, and the backward (the tangent's transpose)."""
