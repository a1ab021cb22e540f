"""A training repository's own package that happens to be called ``operators``."""
