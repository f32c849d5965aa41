"""Checkpoints: sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), atomic and pickle-free on load.

A Lightning checkpoint dict is split into tensors and the rest:

* tensors — the model state (sharded embedding tables as ``ShardedTensor``, dense weights), the
  fused embedding-optimizer state, each rank's dense-optimizer state, RNG state — go through DCP,
  every rank writing its shards in parallel. Rank-local entries (everything but the model and fused
  optimizer state) are stored under ``rank<r>/`` so each rank gets its own back;
* everything else (loop progress, counters, config, MLflow run id) goes to one JSON file per rank,
  with placeholders ``{"__tensor__": key, "shape": ..., "dtype": ...}`` where tensors were.

What the model's state dict does not hold — the fused optimizer state, the data position, RNG
states, the MLflow run id, the non-finite step count and the *layout* the checkpoint fits (model
config, table shapes, world size) — is added and restored by the callback :class:`TrainingState`;
the layout is compared before any tensor is read (:class:`CheckpointMismatchError` lists every
difference).

Writing goes to ``<name>.tmp-<id>``; once every rank is done, rank 0 writes ``manifest.json`` (every
file's size and SHA-256) and renames the directory to ``<name>``: a checkpoint directory without the
``.tmp-`` suffix is always complete, and :func:`verify_checkpoint` tells whether it is still intact
(``trainer.resume=auto`` skips a damaged newest checkpoint for the one before). Running out of space
while writing removes the partial directory and raises :class:`pipeline.runtime.errors.DiskFullError`. Loading reads tensors with
``weights_only`` and DCP's metadata file through an unpickler that accepts only DCP's own metadata
classes and plain containers — no arbitrary objects.

Modules: :mod:`.skeleton` (tensors and the rest), :mod:`.dcp_io` (writing and reading),
:mod:`.training_state` (what a resume needs beside the weights), :mod:`.manifest` (integrity),
:mod:`.safe_reader` (pickle-free metadata), :mod:`.discovery` (which checkpoint), :mod:`.resume`
(``trainer.resume`` and ``trainer.init_from``'s sources), :mod:`.full_state` (a checkpoint's tensors
whole, in one process), :mod:`.run_description` (the model and data a checkpoint was written for),
:mod:`.sharded_checkpoint` (the callback that writes them), :mod:`.chunks` (row chunks).

May import: data, runtime, modules
"""
