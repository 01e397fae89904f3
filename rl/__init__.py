"""quiesce inside NeMo RL: an environment checkpoint backend over one `Coordinator` and its ledger.

Layering: `quiesce.rl` sits beside `quiesce.tools`, above the coordinator (it drives a
`Coordinator` and reads nothing of the ledger but through it). It is the only part of quiesce
that imports Ray, and only inside the functions that talk to Ray actors, so importing
`quiesce.rl` needs no Ray; NeMo RL itself is never imported (its interfaces are matched
structurally).
"""
