"""The benchmark suite behind `verl-fast bench`: timing (timing.py), one benchmark's record (record.py),
model shapes (shapes.py), the suite's benchmarks (ops_*.py), the runner that runs each by name in a
process of its own (runner.py), and the report (report.py)."""
