"""Launching workers: the elastic launcher, cluster environments, users' own programs, stop signals, launch folders."""
