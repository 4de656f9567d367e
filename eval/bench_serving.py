"""Serving load benchmark (hypic vs prefix caching vs full recompute under a RAG trace): now the
``load`` study of ``hypic eval``; this script forwards its arguments there. See
``hypic eval load --help`` (module ``hypic.evaluation.load``) for what is measured.

    python eval/bench_serving.py --methods hypic:8 prefix full --out eval/runs
"""
import sys

from hypic.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "load", *sys.argv[1:]]))
