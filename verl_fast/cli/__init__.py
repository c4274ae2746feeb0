"""The `verl-fast` command: the parser and program (main), `verl-fast train` (train), `verl-fast
info` (info)."""
