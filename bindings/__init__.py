"""Bindings to native checkpointing libraries (installed as ``deepfreeze.bindings``).

Only :mod:`deepfreeze.bindings.veloc` (VeloC's C client API through ctypes) for now.
"""
