"""Training strategies: Hugging Face models laid out by ``sharding.py`` (FSDP2 / FSDP1 / one process),
and Megatron-core (``megatron/``)."""
