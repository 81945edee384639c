"""DLRM model, trainer, evaluation and the ``dlrm`` command line.

Import-light: submodules load torch when they are imported, not this package.
"""
