"""The state side: this rank's fp32 master and AdamW moments per unit (``shard_state``), the
update strategies that own them and decide where they live (``update`` on the device,
``host_update`` in host RAM, ``nvme_update`` on disk through ``swap``; ``transfer`` moves
shards between device and host), chosen by ``placement`` from an ``OffloadConfig``
(``planning/offload_config.py``), and the optimizer's ``state_dict`` (``state_dict``)."""
