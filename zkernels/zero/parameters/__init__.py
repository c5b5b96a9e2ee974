"""The parameter side: which parameters are trained in which groups (``groups``), flat
parameter units and their gather policies (``units``: replicated at stages 1-2, sharded at
stage 3; ``storage``: where a shard's bytes live), stage 3's gather schedule (``stage3``) and
the lazy parameter gathers of ``overlap_param_gather`` (``param_wait``). See [Note: parameters and
state] in ``units.py``."""
