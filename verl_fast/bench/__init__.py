"""The benchmark harness behind `verl-fast bench`: timing (timing.py), model shapes (shapes.py), the
runner that calls each benchmarks/bench_<op>.py by name (runner.py), and the report (report.py)."""
