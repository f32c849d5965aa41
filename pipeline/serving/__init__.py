"""Using a trained model: the model folder (:mod:`.model_folder`), a model folder or checkpoint as a
source (:mod:`.source`), the one reader and writer of weights (:mod:`.weights`, :mod:`.table_files`),
raw rows encoded as in training (:mod:`.row_encoder`), scoring (:mod:`.scorer`, :mod:`.sharded_scorer`),
batch prediction (:mod:`.prediction`) and export (:mod:`.export`).

May import: checkpoint, data, runtime, modules
"""
