"""Algorithms: one module per algorithm (its estimator call, reward shaping, whitening scope and loss),
the phases they share, the losses as pure functions, and the registry by name (``registry.py``)."""
