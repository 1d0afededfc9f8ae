"""Adapters that let serving engines use the worker; each imports its engine itself."""
