"""PyTorch adapter of DeepFreeze (imports torch; the core does not)."""
from __future__ import annotations
