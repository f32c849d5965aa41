"""The scoring server (``ctr serve``): MLflow's scoring protocol over ASGI (:mod:`.app`), request bodies
read without pandas (:mod:`.requests`), dynamic batching (:mod:`.batcher`), model versions and hot swap
(:mod:`.versions`), Prometheus metrics (:mod:`.metrics`).

May import: scoring, model_folder, checkpoint, data, runtime
"""
