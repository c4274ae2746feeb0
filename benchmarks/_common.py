"""The benchmark scripts' plumbing, from the package (verl_fast/bench/record.py and timing.py), so that
a script here and a suite module of the wheel time and save the same way."""

from verl_fast.bench.record import (  # noqa: F401 (the scripts import these from here)
    Ms, Report, Row, copy_bandwidth_gbs, device_name, environment, hbm_bytes_per_s, peak_extra_bytes, results_dir,
    time_ms,
)
from verl_fast.bench.timing import sync  # noqa: F401

RESULTS_DIR = results_dir()
