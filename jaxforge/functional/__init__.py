"""What users call: argument checks, canonicalisation, and the bind of each primitive."""
