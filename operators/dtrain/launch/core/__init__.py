"""The job model and what runs a job's processes, below the launcher and the backends: the spec,
the placement, the prepared job, DeepSpeed's config, the torchrun argv, node supervision, elastic
membership, the rendezvous store, lost nodes, exit records (the rules: dtrain/launch/__init__.py)."""
