"""The coordinator against real reference Gym servers on loopback: discovery, save, publish,
restore, rollback, status and what frees a held server, checkpoint ids, config, the HTTP client.
"""
