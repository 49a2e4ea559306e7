"""http_scorer."""
