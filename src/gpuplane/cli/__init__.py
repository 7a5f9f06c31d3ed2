"""The command line: the top layer, the only one that prints."""
