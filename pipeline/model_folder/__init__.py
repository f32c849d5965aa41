"""A trained model on disk, as training leaves it: the model folder's layout and writer (:mod:`.layout`), the
one reader and writer of its weights (:mod:`.weights`) and tables (:mod:`.table_files`, quantized rows:
:mod:`.quantize`), a model folder or checkpoint as a source (:mod:`.source`), and a checkpoint exported as a
model folder (:mod:`.export`). Scoring it is :mod:`pipeline.scoring`.

May import: checkpoint, data, runtime, modules
"""
