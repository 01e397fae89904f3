"""quiesce inside NeMo RL, with real Ray actors standing in for RL's Gym actors: finding the
deployments from RL's handles, the environment checkpoint backend driven as RL's controller drives
it (snapshot, cut check, exact restore into fresh deployments, a failed restore's cleanup, v1 with
one and two deployments), the backend in a Ray actor killed mid-commit and restarted, a killed
driver left to `quiesce recover`, and the picklable values, errors and `gym_checkpoint.json` RL
reads."""
