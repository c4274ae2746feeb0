"""The `verl-fast` command: the parser and program (main), `verl-fast train` (train), `verl-fast
info` (info), OpenMP's wait policy set before torch loads (openmp_env)."""
