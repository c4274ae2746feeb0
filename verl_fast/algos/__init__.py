"""Algorithms: advantage estimators by name and the losses (policy, value, KL, entropy, DPO)."""
