"""The conformance checker of control plane v1, against the reference servers and a fake Gym that
breaks each rule.
"""
