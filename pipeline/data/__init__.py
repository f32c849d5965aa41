"""Data: raw readers (:mod:`.reader`, :mod:`.other_readers`), feature extraction, the two preprocessing
passes (:mod:`.pass1`, :mod:`.preprocess`) with vocabularies (:mod:`.vocabulary`, :mod:`.vocab_files`,
:mod:`.vocab_growth`) and encoding (:mod:`.encoding`), the columnar store, batches, the data module,
dataset declarations and the synthetic generator.

May import: runtime, modules
"""
