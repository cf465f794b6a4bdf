from mixprec.cli import entry

entry()
