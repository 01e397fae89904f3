"""The command line through real processes: shared flags, progress, snapshots, demo and sim, the
control token (missing or malformed), and quiesce's top-level names beside a user's own packages.
"""
