"""Command-line tools: ``python -m omni_async.tools.<name>``."""
