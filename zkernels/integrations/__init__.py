"""Adapters from zkernels to other libraries' training loops, one module per library.

Nothing here is imported by ``import zkernels``: each module imports its library, which is an
optional extra (``pip install zkernels[hf]`` for :mod:`zkernels.integrations.transformers`,
``zkernels[lightning]`` for :mod:`zkernels.integrations.lightning`).
"""
