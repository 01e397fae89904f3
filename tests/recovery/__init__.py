"""Recovery after a coordinator dies, and a way out of every held state: killed real processes,
the crash matrix at every append and send, a stateful property test of random steps and crashes,
the PostgreSQL standby takeover and the fenced zombie on both planes.
"""
