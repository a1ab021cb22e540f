"""Prints LINES numbered lines as fast as it can, each one long enough to straddle buffer writes."""
import os
import sys

rank, lines = os.environ["RANK"], int(sys.argv[1])
pad = "x" * 200
for i in range(lines):
    print(f"chatty rank={rank} line={i} {pad} end", flush=True)
