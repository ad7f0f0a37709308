"""Cursus-py: a partitioned-log message broker speaking Cursus Wire v2."""

__version__ = "0.1.0"
