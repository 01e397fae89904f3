"""The ledger: appends, durability, staging, fencing, the hash chain, replay (in-process and
parallel), schema and migrations, on SQLite and PostgreSQL.
"""
