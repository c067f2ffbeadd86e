"""The tensor runtime: a step's plan turned into tensors and back into tokens.

``runner`` (``ModelRunner``: swap, pack, forward, sample), ``packer`` (a plan as flat ragged tensors),
``sampling`` (per-request generators), ``baseline`` (the padded static batch every schedule must match
token for token).
"""
