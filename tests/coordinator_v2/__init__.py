"""The coordinator on Gym's unified plane (v2) against real v2 reference servers: a mid-rollout
save and exact restore, blockers, restarts, lease renewals, a lost lease, stop-checkpoints, the
caller's scope, a failed restore's cleanup, retire and forget, several deployments each in its
own folder, a save into the caller's folder published in place, the v2 demo.
"""
