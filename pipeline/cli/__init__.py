"""The command line: `run.py` / `epd-worker` and its subcommands, the settings they
load and check, and `run.py status`."""
