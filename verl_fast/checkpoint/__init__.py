"""The run's checkpoints: sharded, verified step folders (torch DCP) and their HF export (sharded),
the exports' model card (model_card)."""
