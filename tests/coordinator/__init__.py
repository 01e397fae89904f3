"""The coordinator against real reference Gym servers on loopback: discovery, save, publish,
restore, rollback, unacknowledged results, status and what frees a held server (also while
`quiesce serve` holds the ledger), several v1 deployments each in its own folder, checkpoint ids,
config, the HTTP client.
"""
