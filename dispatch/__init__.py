"""Choosing a kernel configuration for each merge call."""
