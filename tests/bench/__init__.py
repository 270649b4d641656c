"""`make bench` (`python -m tests.bench`): what the gateway costs, measured side by side."""
