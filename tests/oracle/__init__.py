"""The wire oracle: strict models of the RL anchor's request and reply field sets, and the hook that
checks every control request the coordinator sends and every reply a reference server gives."""
