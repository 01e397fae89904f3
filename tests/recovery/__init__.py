"""Recovery after a coordinator dies: killed real processes, the crash matrix at every append and
send, the PostgreSQL standby takeover.
"""
