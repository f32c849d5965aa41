"""Scoring raw rows with a trained model (a model folder or a checkpoint, :mod:`pipeline.model_folder`): raw
rows encoded exactly as in training (:mod:`.row_encoder`, :mod:`.joint_index`), scored in one process
(:mod:`.scorer`) or over a checkpoint's shards (:mod:`.sharded_scorer`), and batch prediction over files
(:mod:`.prediction`). The HTTP server on top is :mod:`pipeline.server`.

May import: model_folder, checkpoint, data, runtime, modules
"""
