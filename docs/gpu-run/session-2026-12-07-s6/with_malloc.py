"""Run a script with glibc's thresholds fixed in this process only (mallopt), as a client
that called cpkv.actors.malloc.fix_malloc_thresholds() would."""

import runpy
import sys

from cpkv.actors.malloc import fix_malloc_thresholds

assert fix_malloc_thresholds()
sys.argv = sys.argv[1:]
sys.path.insert(0, "benchmarks")
runpy.run_path(sys.argv[0], run_name="__main__")
