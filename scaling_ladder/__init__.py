"""ladder.py's scaling ladder: its plan, its rungs' runs, the law fitted to them and the report."""
