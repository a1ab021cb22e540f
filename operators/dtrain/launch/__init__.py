"""Launching a distributed training job, grouped by the process each module runs in.

One job involves three kinds of process: an Airflow worker or triggerer (the training task), the
launcher (which the task runs, or the ``dtrain launch`` CLI outside Airflow) and, on every node, the
processes beside the ranks. A module's folder says which of them runs it, and so what it may
import; tests/launch/test_layers.py parses every module here and fails on an import that breaks
these rules (one inside a function counts too).

``airflow/``
    Runs in an Airflow worker (the training task: :class:`DistributedTrainingOperator`, its extra
    links, deferrable mode's operator side, durable mode's re-attach bookkeeping, the retry
    policy) or in the triggerer (:class:`DistributedJobTrigger`). May import Airflow, ``engine/``,
    ``node/``, the backend registry and dtrain's shared modules (errors, rundir, provenance...).
    Named after the system whose processes run it (a trigger is not an operator); imports are
    absolute, so ``import airflow`` anywhere in this package is Airflow itself.

``engine/``
    The launcher: starts a job through a backend, follows it (output, the hang watch), stops it
    and builds the result; also the CLI, the retry classification, the stragglers' watch. Runs
    inside the worker's task for the operator and the trigger, and alone under ``dtrain launch``,
    outside any Airflow deployment: may import ``core/``, ``node/``, the backend registry
    (``dtrain.launch.backends``) and dtrain's shared modules (errors, args, grammar, rundir,
    stall_report), never Airflow nor ``airflow/``.

``core/``
    The job model and what runs a job's processes, shared by the launcher and every backend: the
    spec (a job on a placement), the prepared job, DeepSpeed's config, the torchrun argv, node
    supervision, elastic membership and rounds, the rendezvous store, lost nodes, exit records,
    log tails. Runs in the launcher's process (the rendezvous store in one of its own): may import
    ``node/``, the backend contract and registry (a spec checks itself against the backend's class,
    and the registry resolves its placement) and dtrain's shared modules, never ``engine/``, ``airflow/`` nor Airflow.

``node/``
    Runs beside the ranks on every node, on hosts where Airflow is neither configured nor wanted
    (importing its SDK takes seconds, on every rank's start): the torchrun agent,
    the per-rank wrapper (``python -m dtrain.launch.node.rank_entry``) and what it uses (rank
    logs, placeholders, the env contract, TF_CONFIG, the hang files, DeepSpeed's shm clean-up),
    the process-tree reaper. The training helper (dtrain.training, inside the ranks) imports
    from here too. May import the standard library, psutil, torch (lazily, on the node) and,
    from dtrain, only ``node/``, dtrain.rundir and dtrain.errors.

``backends/``
    The registry (``__init__.py``, which also resolves a placement: ``resolve_placement``), the
    backend contract (``base.py``), the placement they both take (``placement.py``: a plain typed
    value and its options table) and one folder per backend;
    code outside ``backends/<name>/`` reaches a backend only through the registry
    (tests/launch/backends/test_layout.py). A backend's folder holds its code for every process: what the
    launcher calls, its operator option resolution (which may read an Airflow connection) and its
    own node-side agents (ssh: remote_agent, detached_node); it may import ``core/`` and ``node/``,
    never ``engine/``. The registry, the contract and the placement are below the job model: they
    import ``node/`` and dtrain's shared modules (dtrain.options declares the placement's table), and
    the job model's types only for annotations.

The arrows point one way, ``airflow/`` -> ``engine/`` -> ``backends/<name>/`` -> ``core/`` ->
``backends/`` (the registry and the contract) -> ``node/``; nothing here imports the
packages built on launch (dtrain.training, dtrain.ui, dtrain.pipeline, dtrain.plugin and its
macros): the launcher's data-stall report is dtrain.stall_report, beside dtrain.rundir.

Two modules stay at this level, as re-exports of stable public paths: ``dtrain.launch.operator``
(what DAG files import) and ``dtrain.launch.trigger`` (the classpath Airflow stored for tasks
deferred before the move). Everything else is imported from its folder.

This package and its folders import nothing when imported: the rank wrapper and the torchrun agent
start through them.
"""
