"""The paper's Fig. 12 TTFT sweeps on CPU: kept as a script for its command line; the sweeps live in
``hypic.evaluation.scaling`` (also ``hypic eval scaling``). See that module for what is measured.

    python eval/bench_composition.py --quick
"""
import sys

from hypic.evaluation.scaling import *  # noqa: F401,F403  (the script's names, for its callers and tests)
from hypic.evaluation.scaling import main

if __name__ == "__main__":
    outcome = main()
    sys.exit(1 if outcome["strict"] and not outcome["all_passed"] else 0)
