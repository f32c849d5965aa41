"""Data: synthetic Criteo-format generator, preprocessing into a columnar store, data module."""
