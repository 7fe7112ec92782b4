from align.baseline.cli import main
from align.errors import run_cli

run_cli(main)
