"""The command line through real processes: shared flags, progress, snapshots, demo and sim, and
quiesce's top-level names beside a user's own packages.
"""
