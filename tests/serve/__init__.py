"""`quiesce serve` as a real process: the HTTP API, the event stream, metrics, the live page, the
remote client, SIGTERM mid-save and the PostgreSQL standby that takes over.
"""
