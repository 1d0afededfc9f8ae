#!/usr/bin/env python3
"""The EPD encode worker's command line from a source checkout: `epd-worker`'s
(pipeline/cli/main.py) subcommands under the name run.py. `run.py --help` lists them."""
import sys

from pipeline.cli.main import COMMANDS, build_parser, main  # noqa: F401 (the tests and docs check read these)

if __name__ == "__main__":
    sys.exit(main(prog="run.py"))
