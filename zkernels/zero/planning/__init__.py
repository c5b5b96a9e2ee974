"""Planning: what each rung of the ladder keeps and how a model is cut, before anything is
allocated. ``config`` (ZeroConfig: the one description of a run, validated there),
``policy`` (the stage and offload registry: StagePolicy, OffloadPolicy, STAGES, OFFLOADS,
RUNGS), ``offload_config`` (OffloadConfig: the offload knobs), ``buckets`` (stage 1-2
buckets), ``unit_plan`` (stage 3 units), ``estimate`` (bytes per rank and traffic per step),
``ladder`` and ``auto`` (the lowest rung that fits). The optimizer, ``python -m zkernels
plan`` and ``estimate_memory`` all read these; nothing here imports the other sub-packages."""
