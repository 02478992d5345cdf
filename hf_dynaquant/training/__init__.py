"""Training checkpoints: the layer between the numerics and the framework integrations.

:class:`~hf_dynaquant.training.compressor.Compressor` turns a model (and its optimizer) into
DynaQuant checkpoints in a :class:`~hf_dynaquant.store.CheckpointStore`: snapshot, search, plan,
encode, store. Beside it: the optimizer-state encoder, the sharded (FSDP2) compressor, the
background writer and the ``checkpoint-*`` folder conventions the integrations share.
"""
