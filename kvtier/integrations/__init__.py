"""Thin adapters that plug kvtier into inference engines. Core kvtier never imports these."""
