"""The math of every primitive: abstract eval, reference, JVP and batching rules.

Nothing here depends on lowering/, functional/ or transforms/.
"""
