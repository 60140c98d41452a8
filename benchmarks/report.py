"""Placeholder (replaced below)."""


def write(results, doc, plot):
    pass
