"""The command line through real processes: shared flags, output formats that never cut an id,
errors as JSON, commands driven through a running service, completion, config check, progress,
snapshots, demo and sim, the control token (missing or malformed), and quiesce's names beside a
user's own packages.
"""
