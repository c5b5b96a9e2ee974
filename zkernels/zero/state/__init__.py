"""The state side: one update engine (``engine``) over per-unit state records
(``shard_state``: fp32 master, AdamW moments, gradient shard, swap files), placed on the
device, in host RAM or on disk by ``placement`` from an ``OffloadConfig``
(``planning/offload_config.py``); the gradient sink it fills (``grad_sink``), the NVMe files
(``nvme_files`` over ``swap``), host/device copies (``transfer``), and the optimizer's
``state_dict`` (``state_dict``)."""
