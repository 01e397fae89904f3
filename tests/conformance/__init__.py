"""The conformance checker of both control planes, against the reference servers and fake Gyms that
break each rule.
"""
