"""The audit tools: history, show, the protocol check, replay, export and verify-bundle, the HTML
report — on ledgers written by hand and by the real coordinator.
"""
