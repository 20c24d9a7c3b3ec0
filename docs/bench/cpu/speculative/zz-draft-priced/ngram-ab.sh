# Prompt lookup on the two trees, to see the step gate and the shared `_could_pay` change nothing of it:
# /tmp/ab5/new holds `git archive f7cb645 worker mlxq schemas producer`, /tmp/ab5/old the same of 5cba482.
# 8 rows on the arms' 8 slots, grounded and chat alternating, greedy and sampled, 128 tokens, 3 repeats.
bash "$(dirname "$0")/../ab_trees.sh" /tmp/ab5
