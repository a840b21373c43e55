"""The library's version, in a module of its own so that what records it (a manifest's
``library_version``) imports it downward rather than from the package it is part of."""

__version__ = "0.1.0"
