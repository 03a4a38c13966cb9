"""Profiling kernel configurations and recording the winners."""
