"""The built wheel in a fresh virtual environment, as a user installs it: one top-level name, a
base install that answers every command and names a missing extra, and the CLI, embedded API,
service and migrations beside a project that shadows the old top-level names.
"""
