"""`quiesce serve` as a real process: the HTTP API, the event stream, metrics, the live page, the
remote client, status and what frees a held server, resume and abort by any id, acknowledgements,
SIGTERM mid-save and the PostgreSQL standby that takes over.
"""
