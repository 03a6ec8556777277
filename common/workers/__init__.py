"""The workers, one kind a room: the policy (policy.py), the critic (critic.py), the reward model (reward_model.py),
the judge (judge.py) and the rollout workers apart from the policy (rollout.py). Each is a rank of a worker group
(common/worker_group.py); the FSDP2 base they share is common/fsdp_worker.py, the engine they generate with
common/rollout.py."""
