"""Offline throughput benchmark: see ``kimik3/bench.py`` (also ``kimik3 bench``).

    python benchmarks/throughput.py --arch kimi_linear --num-requests 64
"""

import argparse
import sys

from kimik3.bench import add_bench_arguments, bench_main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="kimik3 offline throughput")
    add_bench_arguments(parser)
    sys.exit(bench_main(parser.parse_args()))
