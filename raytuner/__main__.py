from raytuner.cli import entry

entry()
