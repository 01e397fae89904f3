"""The hostile suite: misbehaving servers, tampered ledgers, odd files and filesystems, bad input —
each failure caught, named, and bounded.
"""
