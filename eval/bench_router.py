"""Segment-parallel prefill of cold documents on Ray workers, TTFT against the worker count (paper
Fig. 14): now the ``parallel`` study of ``hypic eval``; this script forwards its arguments there.
See ``hypic eval parallel --help`` (module ``hypic.evaluation.parallel``) for what is measured.

    python eval/bench_router.py --workers 1 2 --out eval/runs
"""
import sys

from hypic.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "parallel", *sys.argv[1:]]))
