"""rl4bit.common: what the trainer, the samplers and the job layer all read and write.

atomic.py (crash-safe file writes and directory swaps), ct_layout.py (the compressed-tensors names and scale
conventions of an exported checkpoint), checkpoint_format.py (the weight entries of a model and their
encoding: one format for exports, run checkpoints and weight sync), checkpoint.py (a run's checkpoint
directories: manifest, shards, rotation), config.py (ConfigError and the checks every config section shares),
weight_update.py (the dense weight-update message an engine applies).

Imports only rl4bit.kernels (tests/foundation/test_import_layers.py holds the rule).
"""
