"""The coordinator against real reference Gym servers on loopback: discovery, save, publish,
restore, rollback, config, the HTTP client.
"""
