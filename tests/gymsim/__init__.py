"""The reference Gym servers (tools/gymsim): fence, phases, agents, resources, model ledger,
faults, exact restore, launcher.
"""
