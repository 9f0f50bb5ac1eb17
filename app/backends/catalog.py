"""Compatibility: the backend catalog moved to ``app.catalog`` (a leaf, so that the config and
the platforms read it without importing the backends package); this old import path keeps
working."""

from app.catalog import CATALOGS, CUSTOM, DECODE_BACKENDS, PREFILL_BACKENDS, BackendCatalog

__all__ = ["CATALOGS", "CUSTOM", "DECODE_BACKENDS", "PREFILL_BACKENDS", "BackendCatalog"]
