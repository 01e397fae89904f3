"""The v2 reference servers (tools/gymsim/v2): the unified plane's phase machine, replay, fencing,
leases, retire marks, manifest-last storage, restarts, the multi-worker environment, exact
restore.
"""
