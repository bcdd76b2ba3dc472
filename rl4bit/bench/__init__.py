"""rl4bit.bench: the `rl4bit bench WHAT` benchmarks, one module each (rl4bit/cli.py's BENCHES names them).

Each prints a table of figures beside their ceiling or baseline and, with `--out`, writes bench_WHAT.json;
common.py holds the timing, copy-bandwidth and sync helpers they share.
"""
