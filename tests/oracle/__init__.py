"""The wire oracle: strict models of both planes' request and reply field sets, and the hook that
checks every control request the coordinator sends and every reply a reference server gives.
"""
