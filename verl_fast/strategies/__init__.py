"""Training strategies: how the actor (its reference, a critic) computes and trains over the ranks, one
implementation per backend (``protocol.py``; ``backends.py`` by name): Hugging Face models under FSDP2 / FSDP1 / one process
(``fsdp_strategy.py``, ``sharding.py``), and Megatron-core (``megatron/``)."""
